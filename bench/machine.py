"""Machine description recorded in every benchmark's JSON."""

from __future__ import annotations

import json
import os
import platform
import sys
from typing import Callable

import torch


def machine_info() -> dict:
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), None)
    except OSError:
        info["cpu"] = None
    return info


def print_table(rows: list[dict], columns: list[str]) -> None:
    """A plain aligned table; floats with 3 decimals."""
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3f}"
        if isinstance(v, dict):
            return " ".join(f"{k}:{fmt(x)}" for k, x in v.items())
        return "-" if v is None else str(v)
    cells = [[fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))


def report(result: dict, rows: list[dict], columns: list[str], header: str, json_out: str | None) -> None:
    """Print a header line and the rows' table; write the whole result as JSON where asked."""
    print(header)
    print_table(rows, columns)
    if json_out:
        with open(json_out, "w") as f:
            json.dump(result, f, indent=2)


def text_bench_main(prog: str, args, run: Callable[[object], dict], rows_key: str, columns: list[str]) -> int:
    """main() of a bench over a text on the real model (fidelity, table_bits): seeded run, then
    the table and the JSON. Bad input found while running (a text shorter than --tokens) is a
    one-line error, exit 2."""
    torch.manual_seed(0)
    try:
        result = run(args)
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    report(result, result[rows_key], columns, f"model={result['model']} text={args.text} tokens={args.tokens} "
           f"keep={args.keep}", args.json_out)
    return 0
