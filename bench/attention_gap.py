"""Why `bench attention` times the 128K batch-1 step ~5 µs slower than `bench step_probe`: the
same default CSAttention step (group routing, 16-bit keys) timed in one process after three
histories.

- alone: right after building its inputs;
- bench_one: inside bench attention's per-context routine (SDPA, dense split-K and every table
  variant before it);
- after_tune: bench_one again after bench attention's tuning sweeps (score kernel, radix block,
  split-K shape), as `bench attention` runs it. Since the sweeps' picks are recorded only (the
  timed rows run the decoder's configs), this phase measures the history alone.

`python -m ctxcache.bench.attention_gap [--contexts 131072] [--batches 1] [--out DIR]`."""

from __future__ import annotations

from ctxcache.bench import attention as bench
from ctxcache.bench import attention_tune as tune
from ctxcache.bench.gpu_inputs import gpu_cli, grid_points
from ctxcache.decoder.gpu.timing import device_info, print_table, write_results
from ctxcache.methods import Budget
from ctxcache.methods.csattention import CSAttentionParams

STEP = "csattention_dense_g16"


def alone(n: int, b: int, budget: Budget) -> list[dict]:
    return bench.bench_dense(*bench.step_inputs(n, b, budget, "cuda"), budget, {"context": n, "batch": b}, "_g16",
                             *bench.DENSE_VARIANTS["_g16"])


def main(argv: list[str] | None = None) -> int:
    args = gpu_cli("ctxcache bench attention_gap", "131072", argv)
    if args is None:
        return 2
    budget, params, rows = Budget(), CSAttentionParams(list_fraction=0.25), []
    n_max = max(args.contexts)
    for phase in ("alone", "bench_one", "after_tune"):
        if phase == "after_tune":
            tune.tune_dense(n_max, args.batches, budget, "cuda")
            tune.tune_topk16(n_max, args.batches, budget, "cuda")
            tune.tune_attention(n_max, args.batches, budget, "cuda")
        for b, n in grid_points(args):
            got = alone(n, b, budget) if phase == "alone" else bench.bench_one(n, b, params, budget, "cuda")
            rows += [{**r, "phase": phase, "attn_pick_now": dict(tune.ATTN_PICK), "topk16_now": dict(tune.TOPK16_BLOCK)}
                     for r in got if r["method"].endswith("_g16") or r["method"].startswith("dense_sdpa")]
    print_table(rows, ["context", "batch", "phase", "method", "time_us"])
    path = write_results("attention_gap", rows, {"step": STEP}, args.out)
    print(f"device {device_info()['name']}; wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
