"""Run the default decode step eagerly (no graph), for a profiler to attach to:
`ncu --clock-control none -k regex:'pass1|collect16|dense_score|split' python -m ctxcache.bench.profile_step`.
`--batch`, `--context`, `--steps` as in the attention bench (random inputs, keep 5%); `--score-dtype
int8` scores int8 tables (kernels/dense_dot8)."""

from __future__ import annotations

import argparse

import torch

from ctxcache.bench.fused_tune import Case
from ctxcache.methods import Budget


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ctxcache.bench.profile_step")
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--score-dtype", default="float16", choices=("float16", "int8"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    c = Case(args.context, args.batch, Budget(), args.score_dtype)
    sel = c.selector(None, None)
    for _ in range(args.steps):
        c.attend(sel.select(c.q, c.tables, c.lo, c.hi, c.kk), False, sel.pdl)
    torch.cuda.synchronize()
    print(f"ran {args.steps} steps at context {args.context}, batch {args.batch}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
