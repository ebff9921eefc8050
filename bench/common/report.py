"""What every benchmark records and prints: the machine, the commit, the date, one table, one
JSON per benchmark and device (`<out>/<bench>_<device>.json`, the latest run replacing the last)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from ctxcache.quality.texts import builtin_text

# every benchmark's default --out: a scratch folder, so a casual run never replaces the committed
# results; `--out bench/results` (from the repository root) updates those
SCRATCH = Path(tempfile.gettempdir()) / "ctxcache-bench"


def add_out(ap, default: Path = SCRATCH, flag: str = "--out", what: str = "the result JSON") -> None:
    ap.add_argument(flag, default=str(default), help=f"folder of {what} (default: {default}; "
                    "`--out bench/results` from the repository root updates the committed results)")


def machine_info() -> dict:
    """CPU, Python and torch; the GPU's name, SMs and memory (with triton and CUDA) where there is one."""
    info = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "cpu": _cpu_name(),
            "cuda": None}
    if torch.cuda.is_available():
        import triton
        p = torch.cuda.get_device_properties(0)
        info.update(cuda=torch.version.cuda, triton=triton.__version__,
                    gpu={"name": p.name, "sms": p.multi_processor_count, "memory_gb": round(p.total_memory / 2**30, 1)})
    return info


def _cpu_name() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            return next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), None)
    except OSError:
        return platform.processor() or None


def device_tag(info: dict | None = None) -> str:
    """Short device name for result files: "h100", "h200", ... for a GPU, "cpu" without one."""
    info = machine_info() if info is None else info
    gpu = (info.get("gpu") or {}).get("name")
    if not gpu:
        return "cpu"
    m = re.search(r"\b([A-Z]{1,2}\d{2,4})\b", gpu.upper())
    return (m.group(1) if m else re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")).lower()


def commit() -> str | None:
    """The checkout's short commit (with "+dirty" for uncommitted changes); None outside git.
    CTXCACHE_COMMIT overrides it where the tree is a copy whose git history is not the source's
    (the GPU machine receives the working tree, not the commits)."""
    if os.environ.get("CTXCACHE_COMMIT"):
        return os.environ["CTXCACHE_COMMIT"]
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    try:
        head = git("rev-parse", "--short", "HEAD")
        return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return None


def write_result(bench: str, payload: dict, out: str | Path = SCRATCH) -> Path:
    """Write `<out>/<bench>_<device>.json` with the bench name, date, commit and machine first."""
    info = machine_info()
    path = Path(out) / f"{bench}_{device_tag(info)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    head = {"bench": bench, "date": datetime.date.today().isoformat(), "commit": commit(), "machine": info}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({**head, **payload}, indent=1))
    tmp.replace(path)
    return path


def print_table(rows: list[dict], columns: list[str]) -> None:
    """A plain aligned table of the columns any row has; floats with 3 significant decimals."""
    columns = [c for c in columns if any(r.get(c) is not None for r in rows)] or columns

    def fmt(v) -> str:
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
        if isinstance(v, dict):
            return " ".join(f"{k}:{fmt(x)}" for k, x in v.items())
        return "-" if v is None else str(v)
    cells = [[fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))


def text_bench_main(prog: str, args, run: Callable[[object], dict], rows_key: str, columns: list[str]) -> int:
    """main() of a bench over a text on the real model (fidelity): seeded run, then the table and
    the JSON. Bad input found while running (a text shorter than --tokens) is a one-line error, exit 2."""
    torch.manual_seed(0)
    try:
        result = run(args)
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    print(f"model={result['model']} text={args.text} tokens={args.tokens} keep={args.keep}")
    print_table(result[rows_key], columns)
    print(f"wrote {write_result(prog.split()[-1], result, args.out)}")
    return 0


def plot_lines(path: Path, series: dict[str, list[tuple[float, float]]], xlabel: str, ylabel: str,
               title: str, logx: bool = True) -> Path | None:
    """One line per series of (x, y) points into a PNG; None (after saying so) without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'ctxcache[bench]'): no PNG written", file=sys.stderr)
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, points in series.items():
        xs, ys = zip(*sorted(points)) if points else ((), ())
        ax.plot(xs, ys, marker="o", label=label)
    if logx:
        ax.set_xscale("log", base=2)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run_together(jobs: list) -> float:
    """Run the callables in threads, all at once; -> wall seconds until the last ends."""
    import threading
    threads = [threading.Thread(target=job) for job in jobs]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def parse_text_args(ap: argparse.ArgumentParser, argv: list[str] | None, min_continuation: int) -> argparse.Namespace:
    """Parse a text bench's arguments (--out, --text, --tokens, --continuation among them) and
    refuse, as argparse errors, a --text that is no text and lengths out of range."""
    add_out(ap, what="the result JSON (<bench>_<device>.json)")
    args = ap.parse_args(argv)
    try:
        builtin_text(args.text)
    except ValueError as e:
        ap.error(str(e))
    if args.tokens < 64 or args.continuation < min_continuation:
        ap.error(f"--tokens={args.tokens} must be >= 64 and --continuation={args.continuation} >= {min_continuation}")
    return args
