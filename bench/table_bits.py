"""`ctxcache bench table_bits`: what coarser dense tables cost in selection quality (CPU).

The dense layout's routed table rows are most of a GPU decode step's selection bytes (int8:
8 MB per layer at 128K). Storing them in 4 bits would halve that, so before any kernel work
this measures the selection on the real model with the rows quantized to fewer levels: each
row symmetric with its own scale (methods/int8_tables.quantize_rows), values in [-L, L]; L = 127
is the stored int8 format, L = 7 what a 4-bit format holds. The integer estimate is exact for
any L, so only the rounding of the table differs. Same capture, fp16 tables built once, the
selection metrics of `bench fidelity` (bench/selection_metrics.py).

`ctxcache bench table_bits [--tokens 4096] [--text prose|code|PATH] [--levels 127,15,7] [--json OUT]`
"""

from __future__ import annotations

import argparse
import sys
from functools import partial


from ctxcache.methods import Budget, make_method
from ctxcache.methods.int8_tables import int8_dense_tables, quantize_rows
from ctxcache.models.loader import DEFAULT_MODEL, load_model

from ctxcache.bench.capture import build_tables, capture
from ctxcache.bench.machine import machine_info, text_bench_main
from ctxcache.bench.selection_metrics import selection_metrics
from ctxcache.bench.texts import builtin_text, parse_text_args, tokens_of

COLUMNS = ["tables", "mass_recall", "topk_recall", "mass_recall_per_head", "output_rel_error"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="ctxcache bench table_bits", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--tokens", type=int, default=4096, help="context length N")
    ap.add_argument("--continuation", type=int, default=64, help="decode steps scored (every --stride-th)")
    ap.add_argument("--stride", type=int, default=8)
    ap.add_argument("--keep", type=float, default=0.05)
    ap.add_argument("--text", default="prose", help="prose | code | PATH to a text file")
    ap.add_argument("--levels", default="127,15,7", help="comma-separated L in [1, 127]")
    args = parse_text_args(ap, argv, 1)
    try:
        args.levels = [int(x) for x in args.levels.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--levels={args.levels!r} must be comma-separated integers")
    if not args.levels or any(not 1 <= x <= 127 for x in args.levels):
        ap.error(f"--levels={args.levels} must be integers in [1, 127]")
    return args


def run(args: argparse.Namespace) -> dict:
    lm = load_model(args.model)
    budget = Budget(args.keep)  # 4 sinks, 32 recent, as bench fidelity
    ids = tokens_of(lm.tokenizer, builtin_text(args.text), args.tokens + args.continuation, args.text)
    cap = capture(lm, ids, args.tokens)
    method = make_method("csattention", {"table_dtype": "float16"})
    fp16 = build_tables(method, cap)
    rows = [{"tables": "float16", **selection_metrics(method, fp16, cap, budget, args.stride)}]
    for levels in args.levels:
        coarse = [int8_dense_tables(t, partial(quantize_rows, levels=levels)) for t in fp16]
        rows.append({"tables": f"int, levels +-{levels}", "levels": levels,
                     **selection_metrics(method, coarse, cap, budget, args.stride)})
        print(f"[table_bits] levels {levels} done", file=sys.stderr, flush=True)
    return {"bench": "table_bits", "model": lm.model_id, "tokens": args.tokens, "text": args.text,
            "keep": args.keep, "continuation": args.continuation, "stride": args.stride,
            "params": method.params.to_dict(), "machine": machine_info(), "rows": rows}


def main(argv: list[str] | None = None) -> int:
    return text_bench_main("ctxcache bench table_bits", parse_args(argv), run, "rows", COLUMNS)


if __name__ == "__main__":
    sys.exit(main())
