"""Launch-shape sweeps of the decode step's two heaviest kernels, the measured floor beside them,
and the whole step with the picks against the defaults and SDPA, in one process.

- attention: the split-K sparse attention's key block, warps, software-pipelining stages and
  split count (waves over the SMs) over the default's own selection;
- score: the score kernel's warps, register cap and keys per program (route + score, as
  `bench attention`'s "score" column);
- floor (bench/floor.py): dependent-launch chains, a stream of the table bytes, a gather of the
  selected K/V;
- step: route -> score -> radix pass 1 -> collect -> split-K -> merge for each of STEP_VARIANTS
  (score kernel warps, radix block and warps), with the default attention
  config and the attention sweep's pick, and the selection alone; `same_selection`: the
  variant selects the default's key sets.

`python -m ctxcache.bench.step_probe [--contexts 131072] [--batches 1,8] [--sweeps attention,score,floor]
[--score-dtype float16|int8] [--variants NAME,...] [--out DIR]`
(`ctxcache bench step_probe`, `bench/gpu_suite.sh probe`)."""

from __future__ import annotations

import argparse
import itertools

import torch

from ctxcache.bench.attention import attend as attend_as_decoder, attn_splits, sdpa_dense
from ctxcache.bench.floor import floor_rows
from ctxcache.bench.fused_tune import Case, cases
from ctxcache.bench.gpu_inputs import gpu_cli
from ctxcache.decoder.gpu.attention import ATTN_CFG
from ctxcache.decoder.gpu.timing import capture, device_info, print_table, time_us, write_results
from ctxcache.methods import Budget

ATTN_SWEEP = {"block_n": (64, 128), "num_warps": (4, 8), "num_stages": (1, 2, 3, 4), "waves": (2, 4)}
SCORE_SWEEP = {"num_warps": (4, 8), "maxnreg": (None, 64, 72, 80), "block": (1024, 2048)}


def grid(sweep: dict) -> list[dict]:
    return [dict(zip(sweep, v)) for v in itertools.product(*sweep.values())]


def timed(fn) -> float:
    return time_us(capture(fn).replay)


def attend(c: Case, idx: torch.Tensor, cfg: dict, pdl: bool) -> torch.Tensor:
    """bench attention's launch with a swept shape (min_keys stays ATTN_CFG's)."""
    cfg = {**ATTN_CFG, **cfg}
    splits = attn_splits(c.batch, c.top_k, c.budget, cfg)
    return attend_as_decoder(c.q, c.k, c.v, c.nt, idx, c.kk, c.budget, splits, pdl, cfg)


def sweep_attention(c: Case, base: dict) -> tuple[list[dict], dict]:
    sel = c.selector(None, None)
    idx = sel.select(c.q, c.tables, c.lo, c.hi, c.kk).clone()
    rows = [{**base, "method": "attn_" + "_".join(f"{k}{v}" for k, v in cfg.items()), "part": "attention",
             "time_us": timed(lambda: attend(c, idx, cfg, sel.pdl)), "cfg": cfg} for cfg in grid(ATTN_SWEEP)]
    return rows, min(rows, key=lambda r: r["time_us"])["cfg"]


def sweep_score(c: Case, base: dict) -> tuple[list[dict], dict]:
    sel = c.selector(None, None)
    default = dict(sel.dense_cfg)
    rows = []
    for cfg in grid(SCORE_SWEEP):
        sel.dense_cfg = {**default, **cfg}
        rows.append({**base, "method": "score_" + "_".join(f"{k}{v}" for k, v in cfg.items()), "part": "score",
                     "time_us": timed(lambda: sel.route_dense(c.q, c.tables, c.lo, c.hi, c.kk)), "cfg": cfg})
    best = min(rows, key=lambda r: r["time_us"])["cfg"]
    sel.dense_cfg = {**default, **best}
    rows.append({**base, "method": "score_best_without_hist0", "part": "score", "cfg": best,
                 "time_us": timed(lambda: sel.route_dense(c.q, c.tables, c.lo, c.hi, c.kk, hist0=False))})
    return rows, best


# step variants: name -> selector settings (score kernel overrides, radix block and warps)
STEP_VARIANTS = {
    "default": {},
    **{f"score_w{w}": {"dense_cfg": {"num_warps": w}} for w in (4, 8)},
    **{f"topk{b}_w{w}": {"topk": (b, w)} for b, w in ((1024, 4), (2048, 4), (4096, 4), (4096, 8))},
    "score_rows_evict_normal": {"dense_cfg": {"evict_first": False}},
    "score_tl_histogram": {"dense_cfg": {"smem_hist": False}},  # pass 0 by tl.histogram (the earlier default)
}
# int8 tables (with 16-bit keys: the integer-dot kernel, kernels/dense_dot8): its launch shapes,
# the shift path instead of the PTX dp4a, and normal eviction of the rows
INT8_VARIANTS = {
    **{f"dot8_b{b}_w{w}": {"dot8_cfg": {"block": b, "num_warps": w}} for b, w in ((1024, 4), (2048, 8), (2048, 4),
                                                                                 (512, 2), (1024, 2))},
    "dot8_shift": {"dot8_cfg": {"asm": False}},
    "dot8_evict_normal": {"dot8_cfg": {"evict_first": False}},
    "dot8_topk4096_w8": {"topk": (4096, 8)},
    "dot8_tl_histogram": {"dot8_cfg": {"smem_hist": False}},
    "dot8_nreg80": {"dot8_cfg": {"maxnreg": 80}},  # the default caps at 96
    "dot8_nocap": {"dot8_cfg": {"maxnreg": None}},
}


def configured(c: Case, settings: dict):
    sel = c.selector(None, None)
    sel.dense_cfg = {**sel.dense_cfg, **settings.get("dense_cfg", {})}
    sel.dot8_cfg = {**sel.dot8_cfg, **settings.get("dot8_cfg", {})}
    if "topk" in settings:
        sel.set_topk_block(*settings["topk"])
    return sel


def step_variants(score_dtype: str, only: list[str]) -> dict[str, dict]:
    """The step variants for this table type (int8 tables: the fp16 score kernel's settings do
    not apply), or only those named (and the default)."""
    variants = STEP_VARIANTS if score_dtype != "int8" else {"default": {}, **INT8_VARIANTS}
    unknown = set(only) - set(variants)
    if unknown:
        raise SystemExit(f"unknown step variants {sorted(unknown)}; known: {sorted(variants)}")
    return {name: v for name, v in variants.items() if not only or name == "default" or name in only}


def step_rows(c: Case, base: dict, attn_cfg: dict | None, variants: dict[str, dict]) -> list[dict]:
    """The whole step per variant (default attention config, and the attention sweep's pick)."""
    default_attn = {k: ATTN_CFG[k] for k in ATTN_SWEEP}
    ref = c.selector(None, None)
    want = ref.select(c.q, c.tables, c.lo, c.hi, c.kk)[..., :c.top_k].sort(-1).values.clone()
    rows = []
    for name, settings in variants.items():
        sel = configured(c, settings)
        same = torch.equal(sel.select(c.q, c.tables, c.lo, c.hi, c.kk)[..., :c.top_k].sort(-1).values, want)
        for tag, a_cfg in (("", default_attn), ("_attn_pick", attn_cfg)):
            if a_cfg is None or (tag and a_cfg == default_attn):
                continue
            t = timed(lambda: attend(c, sel.select(c.q, c.tables, c.lo, c.hi, c.kk), a_cfg, sel.pdl))
            rows.append({**base, "method": f"step_{name}{tag}", "part": "step", "time_us": t, "settings": settings,
                         "attn_cfg": a_cfg, "same_selection": same})
        sel.select(c.q, c.tables, c.lo, c.hi, c.kk)
        rows.append({**base, "method": f"select_{name}", "part": "select", "settings": settings,
                     "time_us": timed(lambda: sel.select(c.q, c.tables, c.lo, c.hi, c.kk))})
    rows.append({**base, "method": "dense_sdpa_flash", "part": "step",
                 "time_us": timed(lambda: sdpa_dense(c.q[:, :, None], c.k, c.v))})
    return rows


def summary(rows: list[dict], best: int = 3) -> list[dict]:
    """The fastest `best` configs of each sweep, then every step and floor row."""
    out = []
    for part in ("attention", "score"):
        out += sorted((r for r in rows if r.get("part") == part), key=lambda r: r["time_us"])[:best]
    return out + [r for r in rows if r.get("part") in ("step", "select", None)]


def main(argv: list[str] | None = None) -> int:
    def extra(ap: argparse.ArgumentParser) -> None:
        ap.add_argument("--sweeps", default="attention,score,floor", help="which of attention,score,floor to run")
        ap.add_argument("--score-dtype", default="float16", choices=("float16", "int8"),
                        help="the dense tables' storage (int8: per-row scale; runs INT8_VARIANTS)")
        ap.add_argument("--variants", default="", help="comma-separated step variants to run (default: all)")
    args = gpu_cli("ctxcache bench step_probe", "131072", argv, extra)
    if args is None:
        return 2
    rows, budget, sweeps = [], Budget(), args.sweeps.split(",")
    variants = step_variants(args.score_dtype, [v for v in args.variants.split(",") if v])
    for c in cases(args, budget, args.score_dtype):
        n, b = c.n, c.batch
        base = {"context": n, "batch": b, "top_k": c.top_k, "score_dtype": args.score_dtype}
        got, attn_pick = sweep_attention(c, base) if "attention" in sweeps else ([], None)
        got += sweep_score(c, base)[0] if "score" in sweeps else []
        got += step_rows(c, base, attn_pick, variants)
        if "floor" in sweeps:
            # Hkv x m routed rows x N of the tables' dtype
            got += floor_rows(n, b, budget.top_k(n), table_bytes=b * 8 * 8 * n * c.tables.dense_score.element_size())
        print_table(summary(got), ["context", "batch", "method", "time_us"])
        rows += got
        del c
    path = write_results("step_probe", rows, {"attn_sweep": ATTN_SWEEP, "score_sweep": SCORE_SWEEP}, args.out)
    print(f"device {device_info()['name']}; wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
