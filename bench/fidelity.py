"""`ctxcache bench fidelity`: how closely sparse decode follows full attention on a real model.

Per method: selection quality on decode queries (quality/selection.py), teacher-forced
top-1 agreement and NLL over a continuation and passkey accuracy (quality/model_scores.py),
all on the same text, tokens and seeds. Prints a table, writes <out>/fidelity_<device>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


from ctxcache.decoder import SparseConfig
from ctxcache.methods import Budget, make_method
from ctxcache.models.loader import DEFAULT_MODEL, load_model

from ctxcache.quality.capture import build_tables, capture
from ctxcache.bench.common.report import parse_text_args, text_bench_main
from ctxcache.quality.model_scores import passkey_accuracy, teacher_forced
from ctxcache.quality.selection import selection_metrics
from ctxcache.quality.texts import builtin_text, tokens_of

DEFAULT_METHODS = "full,oracle,csattention-paper,csattention,key-kmeans"
COLUMNS = ["name", "mass_recall", "topk_recall", "mass_recall_per_head", "output_rel_error",
           "top1_agreement", "nll_delta_pct", "passkey", "build_s"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="ctxcache bench fidelity", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--tokens", type=int, default=4096, help="context length N")
    ap.add_argument("--continuation", type=int, default=256, help="teacher-forced decode steps")
    ap.add_argument("--keep", type=float, default=0.05)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--recent", type=int, default=32)
    ap.add_argument("--text", default="prose", help="prose | code | PATH to a text file")
    ap.add_argument("--methods", default=DEFAULT_METHODS, help="comma-separated; 'full' = dense")
    ap.add_argument("--params", default="{}", help='JSON {method: {param: value}} overrides')
    ap.add_argument("--stride", type=int, default=8, help="score every stride-th decode step")
    ap.add_argument("--passkey-lengths", default="2048,4096")
    ap.add_argument("--passkey-trials", type=int, default=10, help="0 skips passkey")
    return parse_text_args(ap, argv, 2)


def _methods(args: argparse.Namespace) -> dict:
    overrides = json.loads(args.params)
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    return {n: None if n == "full" else make_method(n, overrides.get(n)) for n in names}


def run(args: argparse.Namespace) -> dict:
    lm = load_model(args.model)
    config = SparseConfig(Budget(args.keep, args.sinks, args.recent))
    methods = _methods(args)
    ids = tokens_of(lm.tokenizer, builtin_text(args.text), args.tokens + args.continuation, args.text)
    cap = capture(lm, ids, args.tokens)
    rows = []
    for name, method in methods.items():
        t0 = time.perf_counter()
        tables = build_tables(method, cap) if method else None
        row = {"name": name, "build_s": time.perf_counter() - t0}
        if method is not None:
            row.update(selection_metrics(method, tables, cap, config.budget, args.stride))
            row["params"] = method.params.to_dict()
        row.update(teacher_forced(lm, ids, cap, method, tables, config))
        rows.append(row)
        print(f"[fidelity] {name} done in {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
    del cap
    lengths = [int(x) for x in args.passkey_lengths.split(",") if x] if args.passkey_trials else []
    for length in lengths:
        acc = passkey_accuracy(lm, methods, length, args.passkey_trials, config)
        for row in rows:
            row.setdefault("passkey", {})[str(length)] = acc[row["name"]]
    return {"model": lm.model_id, "tokens": args.tokens, "keep": args.keep, "text": args.text,
            "continuation": args.continuation, "sinks": args.sinks, "recent": args.recent,
            "passkey_trials": args.passkey_trials, "methods": rows}


def main(argv: list[str] | None = None) -> int:
    return text_bench_main("ctxcache bench fidelity", parse_args(argv), run, "methods", COLUMNS)


if __name__ == "__main__":
    sys.exit(main())
