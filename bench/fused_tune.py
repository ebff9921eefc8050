"""CSAttention step variants in one process, against SDPA: the radix pipeline (route -> score
-> radix pass 1 -> collect -> split-K -> merge) with and without programmatic dependent launch
and with the merge fused into the split-K kernel, and the fused pipeline (dense_keys ->
select16 -> split-K). The fastest is then broken down into scores / select / attention.

`python -m ctxcache.bench.fused_tune [--contexts 8192,32768,131072] [--batches 1,8] [--out DIR]`
(also run by `ctxcache bench attention`, which records the pick)."""

from __future__ import annotations

import dataclasses
from typing import Iterator

import torch

from ctxcache.bench.attention import attn_splits
from ctxcache.bench.gpu_inputs import D, HKV, HQ, gpu_cli, grid_points, random_dense_tables
from ctxcache.decoder.gpu.attention import ATTN_CFG
from ctxcache.decoder.gpu.selector import FusedConfig, GpuSelector
from ctxcache.decoder.gpu.timing import capture, device_info, print_table, time_us, write_results
from ctxcache.kernels.sparse_attention import region, sparse_decode_attention
from ctxcache.methods import Budget
from ctxcache.methods.csattention import CSAttentionParams

BASE = FusedConfig(key_block=2048, select_block=2048, fuse_route=False, num_warps=8)
VARIANTS = {  # name -> (fused config or None for the radix pipeline, PDL, fuse the attention merge)
    "radix": (None, False, False),
    "radix_pdl": (None, True, False),
    "radix_pdl_merge": (None, True, True),
    "fused": (BASE, True, False),
    "fused_route": (dataclasses.replace(BASE, fuse_route=True), True, False),
    "fused_sb4096": (dataclasses.replace(BASE, select_block=4096), True, False),
}


@dataclasses.dataclass
class Case:
    """Random inputs of one (context, batch) at Llama-3.1-8B shapes."""

    n: int
    batch: int
    budget: Budget
    score_dtype: str = "float16"  # the dense tables' storage: float16, or int8 with a per-row scale

    def __post_init__(self) -> None:
        dev, b, n = "cuda", self.batch, self.n
        self.q = torch.randn(b, HQ, D, device=dev, dtype=torch.bfloat16)
        self.k = torch.randn(b, HKV, n, D, device=dev, dtype=torch.bfloat16)
        self.v = torch.randn_like(self.k)
        self.nt = torch.full((b,), n, dtype=torch.int32, device=dev)
        self.lo, self.hi = region(self.nt, self.budget.sinks, self.budget.recent)
        self.top_k = min(self.budget.top_k(n), n - self.budget.sinks - self.budget.recent)
        self.kk = torch.full((b,), self.top_k, dtype=torch.int32, device=dev)
        self.tables = random_dense_tables(b, n, CSAttentionParams(), dev, self.score_dtype)
        self.splits = attn_splits(b, self.top_k, self.budget)  # the decoder's split count (ATTN_CFG)
        self.counter = torch.zeros(b * HKV, dtype=torch.int32, device=dev)

    def selector(self, fused: FusedConfig | None, pdl: bool) -> GpuSelector:
        return GpuSelector(CSAttentionParams(), self.batch, HQ, HKV, D, self.n, self.top_k, "cuda", fused=fused, pdl=pdl)

    def default_selection(self) -> tuple[dict, GpuSelector, torch.Tensor]:
        """A result row's (context, batch, top_k), the default selector (PDL where the GPU has
        it) and a copy of its selection."""
        sel = self.selector(None, None)
        idx = sel.select(self.q, self.tables, self.lo, self.hi, self.kk).clone()
        return {"context": self.n, "batch": self.batch, "top_k": self.top_k}, sel, idx

    def attend(self, idx: torch.Tensor, fuse_merge: bool, pdl: bool) -> torch.Tensor:
        return sparse_decode_attention(self.q, self.k, self.v, self.nt, idx, self.kk, self.budget.sinks,
                                       self.budget.recent, splits=self.splits, block_n=ATTN_CFG["block_n"],
                                       merge_counter=self.counter if fuse_merge else None, pdl=pdl)

    def step(self, sel: GpuSelector, fuse_merge: bool) -> torch.Tensor:
        return self.attend(sel.select(self.q, self.tables, self.lo, self.hi, self.kk), fuse_merge, sel.pdl)


def cases(args, budget: Budget, score_dtype: str = "float16") -> Iterator[Case]:
    """One Case per (batch, context) of gpu_cli's arguments (gpu_inputs.grid_points)."""
    for b, n in grid_points(args):
        yield Case(n, b, budget, score_dtype)


def timed(fn) -> float:
    return time_us(capture(fn).replay)


def same_selection(a: GpuSelector, b: GpuSelector, c: Case) -> bool:
    """The fused and the earlier pipeline pick the same key set in every row."""
    ia = a.select(c.q, c.tables, c.lo, c.hi, c.kk)[..., :c.top_k].sort(-1).values
    ib = b.select(c.q, c.tables, c.lo, c.hi, c.kk)[..., :c.top_k].sort(-1).values
    return bool(torch.equal(ia, ib))


def run_case(c: Case) -> list[dict]:
    base = {"context": c.n, "batch": c.batch, "top_k": c.top_k, "splits": c.splits}
    from ctxcache.bench.attention import sdpa_dense
    q4 = c.q[:, :, None]
    rows = [{**base, "method": "dense_sdpa_flash", "time_us": timed(lambda: sdpa_dense(q4, c.k, c.v))}]
    old = c.selector(None, False)
    for name, (cfg, pdl, fuse_merge) in VARIANTS.items():
        sel = c.selector(cfg, pdl)
        rows.append({**base, "method": f"cs_{name}", "time_us": timed(lambda: c.step(sel, fuse_merge)), "pdl": pdl,
                     "cfg": dataclasses.asdict(cfg) if cfg else None, "fuse_merge": fuse_merge,
                     "same_selection_as_radix": same_selection(sel, old, c)})
    return rows


def breakdown(c: Case, cfg: FusedConfig | None, pdl: bool, fuse_merge: bool) -> list[dict]:
    """Launch by launch for one config: scores (with the route), select, attention."""
    sel = c.selector(cfg, pdl)
    idx = sel.select(c.q, c.tables, c.lo, c.hi, c.kk)
    if cfg is None:
        keys = lambda: sel.route_dense(c.q, c.tables, c.lo, c.hi, c.kk)  # noqa: E731
    else:
        keys = lambda: sel.fused_keys(c.q, c.tables, c.lo, c.hi, c.kk)  # noqa: E731
    parts = {"scores": keys, "select": lambda: sel.select(c.q, c.tables, c.lo, c.hi, c.kk),
             "attention": lambda: c.attend(idx, fuse_merge, sel.pdl)}
    base = {"context": c.n, "batch": c.batch, "pdl": pdl, "fused": cfg is not None}
    return [{**base, "method": f"cs_part_{k}", "time_us": timed(fn)} for k, fn in parts.items()]


def main(argv: list[str] | None = None) -> int:
    args = gpu_cli("ctxcache bench fused_tune", "8192,32768,131072", argv)
    if args is None:
        return 2
    rows = []
    for c in cases(args, Budget()):
        got = run_case(c)
        best = min((r for r in got if r["method"].startswith("cs_")), key=lambda r: r["time_us"])
        got += breakdown(c, FusedConfig(**best["cfg"]) if best["cfg"] else None, best["pdl"], best["fuse_merge"])
        print_table(got, ["context", "batch", "method", "time_us"])
        rows += got
        del c
    path = write_results("fused_tune", rows, {"variants": list(VARIANTS), "attn": ATTN_CFG}, args.out)
    print(f"device {device_info()['name']}; wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
