"""Timing and result helpers shared by the GPU benchmarks (graph replay, median of events)."""

from __future__ import annotations

import datetime
import json
import platform
from pathlib import Path
from typing import Callable

import torch


def device_info() -> dict:
    if not torch.cuda.is_available():
        return {"name": platform.processor() or "cpu", "torch": torch.__version__}
    p = torch.cuda.get_device_properties(0)
    import triton
    return {"name": p.name, "sms": p.multi_processor_count, "memory_gb": round(p.total_memory / 2**30, 1),
            "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda}


def capture(fn: Callable[[], object], warmup: int = 2) -> torch.cuda.CUDAGraph:
    """Run fn a few times on a side stream (compiles, allocates), then capture it."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def time_us(fn: Callable[[], object], rep_ms: int = 100) -> float:
    """Median time in microseconds (triton do_bench: events, L2 flushed before each run)."""
    import triton.testing
    return 1000.0 * triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")


def write_results(bench: str, rows: list[dict], extra: dict | None = None,
                  folder: str | Path = "bench/results") -> Path:
    dev = device_info()
    tag = dev["name"].replace(" ", "-").replace("/", "-")
    date = datetime.date.today().isoformat()
    path = Path(folder) / f"{bench}_{tag}_{date}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"bench": bench, "device": dev, "date": date, **(extra or {}),
                                "rows": rows}, indent=1))
    return path


def print_table(rows: list[dict], cols: list[str]) -> None:
    print(" | ".join(f"{c:>12}" for c in cols))
    for r in rows:
        print(" | ".join(f"{r.get(c, ''):>12.1f}" if isinstance(r.get(c), float) else f"{str(r.get(c, '')):>12}"
                         for c in cols))
