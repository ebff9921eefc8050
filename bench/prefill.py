"""Per-layer question prefill on a resident context: what admission adds to the decode steps.

Llama-3.1-8B attention shapes (32 query heads, 8 KV heads, head_dim 128, bf16), one layer, a prompt
padded to `--tokens` (slot_prefill.PAD_TO) over random K/V: the prefill attention through SDPA
(lower-right causal, GQA: each query head reads its KV head's keys) and through the packed path
(models/packed_attention.py: each KV head's keys read once, the context cut into spans; swept over
span counts, with the spans by flash attention and by kernels/span_attention.py), then what a sparse
prefill adds per layer: CSAttention's follow seed (the last real query's exact Top-`follow` in the
budget's region, its probabilities by the torch chain and by kernels/seed_probs.py, whatever
FUSED_SEED says) and the index insert of the prompt's keys. Each is captured in a CUDA graph and
timed by replay (median, L2 emptied); the floor is the layer's K/V bytes at the card's measured copy
bandwidth.
`ctxcache bench prefill [--contexts 32768,...] [--tokens 32] [--profile] [--out DIR]`."""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from ctxcache.bench.common.gpu import D, HKV, HQ, gpu_cli
from ctxcache.kernels.timing import capture_graph, time_us
from ctxcache.bench.common.report import print_table, write_result
from ctxcache.bench.common.serve_limits import copy_bandwidth
from ctxcache.decoder.gpu.tables import GpuDenseTables
from ctxcache.decoder.gpu.slot_prefill import SeedPadding
from ctxcache.kernels import seed_probs, span_attention
from ctxcache.kernels.topk import blocks16, workspace
from ctxcache.methods import Budget
from ctxcache.methods.csattention import CSAttentionParams
from ctxcache.models import packed_attention

SPANS = (8, 16, 32, 64, 128)
# the span kernel's launch shapes (kernels/span_attention.py: keys a step, warps, stages; its default first)
SPAN_SHAPES = ((64, 8, 3), (64, 4, 3), (128, 8, 2), (32, 4, 4))


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2]),
                                          enable_gqa=True)


def _timed(fn) -> float:
    return time_us(capture_graph(fn).replay)


def _seed_tables(n: int, params: CSAttentionParams, dev: str) -> GpuDenseTables:
    m, c = params.subspaces, params.centroids
    like = {"centroids": torch.zeros(HKV, m, c, D // m, device=dev),
            "dense_score": torch.zeros(HKV, m, c, 16, dtype=torch.int8, device=dev),
            "dense_scale": torch.zeros(HKV, m, c, device=dev)}
    tables = GpuDenseTables.empty(1, like, n, 256, dev, follow=params.follow)
    tables.centroids.normal_()
    return tables


def bench_one(n: int, tokens: int, real: int, budget: Budget, params: CSAttentionParams, bandwidth: float,
              profile: bool = False) -> dict:
    dev = "cuda"
    s = n + tokens
    q = torch.randn(1, HQ, tokens, D, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(1, HKV, s + 256, D, device=dev, dtype=torch.bfloat16)[:, :, :s] for _ in range(2))
    row = {"context": n, "tokens": tokens, "floor_us": 2 * k.numel() * 2 / bandwidth * 1e6}
    want = _sdpa(q, k, v).float()
    row["sdpa_us"] = _timed(lambda: _sdpa(q, k, v))
    for spans in (None, *SPANS):
        tag = "packed" if spans is None else f"packed{spans}"
        def run(spans: int | None = spans) -> torch.Tensor:
            return packed_attention.packed_appended_attention(q, k, v, spans)
        row[f"{tag}_err"] = (run().float() - want).abs().max().item()
        row[f"{tag}_us"] = _timed(run)
    row["spans"] = packed_attention.spans_for(HKV * -(-HQ // HKV * tokens // 128), n)
    row.update(_span_kernel(q, k, v, want))
    tables = _seed_tables(s, params, dev)
    tables.n_ctx.fill_(n)
    real_t = torch.tensor([real], dtype=torch.int32, device=dev)
    padding = SeedPadding.of(n, real_t, tokens, budget, params.follow)
    last = q[0, :, real - 1]
    chain, fused = (_seed(last, k[0], padding, tables.follow_prev[0], f) for f in (False, True))
    row["seed_chain_us"], row["seed_fused_us"] = _timed(chain), _timed(fused)
    row["seed_fused_overlap"] = _overlap(chain, fused, tables.follow_prev[0])
    row["insert_us"] = _timed(lambda: tables.insert_span(0, k[0, :, n:], 0, None, real_t))
    row["speedup"] = row["sdpa_us"] / row["packed_us"]
    if profile:
        _kernel_table({"seed": chain, "seed_fused": fused, "insert": lambda: tables.insert_span(0, k[0, :, n:], 0, None, real_t),
                       "packed": lambda: packed_attention.packed_appended_attention(q, k, v), "sdpa": lambda: _sdpa(q, k, v)}, n)
    return row


def _span_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, want: torch.Tensor) -> dict:
    """The packed path with its spans by kernels/span_attention.py (packed_attention.SPAN_KERNEL):
    spankN_us at N spans in the kernel's default shape, and the fastest span count and shape
    within the flash path's error."""
    was = packed_attention.SPAN_KERNEL, span_attention.BLOCK_N, span_attention.NUM_WARPS, span_attention.NUM_STAGES
    out, best = {}, None
    try:
        packed_attention.SPAN_KERNEL = True
        for shape in SPAN_SHAPES:
            span_attention.BLOCK_N, span_attention.NUM_WARPS, span_attention.NUM_STAGES = shape
            for spans in SPANS:
                def run(spans: int = spans) -> torch.Tensor:
                    return packed_attention.packed_appended_attention(q, k, v, spans)
                err, us = (run().float() - want).abs().max().item(), _timed(run)
                if shape == SPAN_SHAPES[0]:
                    out[f"spank{spans}_us"], out[f"spank{spans}_err"] = us, err
                if err < 0.05 and (best is None or us < best[0]):
                    best = (us, {"spans": spans, "block_n": shape[0], "num_warps": shape[1], "num_stages": shape[2]})
    finally:
        (packed_attention.SPAN_KERNEL, span_attention.BLOCK_N, span_attention.NUM_WARPS,
         span_attention.NUM_STAGES) = was
    return {**out, "spank_best_us": best[0] if best else None, "spank_best": best[1] if best else None}


def _seed(last: torch.Tensor, keys: torch.Tensor, padding: SeedPadding, prev: torch.Tensor, fused: bool):
    """seed_follow's seed (seed_probs.seed_topk: 16-bit keys, radix Top-K) with its probabilities
    by the torch chain (seed_probs_ref) or the three launches, whatever FUSED_SEED says."""
    hkv, n, _ = keys.shape
    ws = workspace(hkv, keys.device, blocks16(n + 16, seed_probs.RADIX_BLOCK))

    def run() -> None:
        was, seed_probs.FUSED_SEED = seed_probs.FUSED_SEED, fused  # read while the launches are made
        try:
            seed_probs.seed_topk(last, keys, padding.bounds, ws, prev[None], padding.keys, padding.mask)
        finally:
            seed_probs.FUSED_SEED = was
    return run


def _overlap(seed, fused, prev: torch.Tensor) -> float:
    """Of the keys the torch chain seeds, the share the fused seed also seeds (its logits stay
    fp32, the chain's are rounded to the keys' dtype: near-ties may go either way)."""
    seed()
    want = prev.clone()
    fused()
    same = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(want.cpu(), prev.cpu()))
    return same / want.numel()


def _kernel_table(parts: dict, n: int) -> None:
    """Each part's kernels by GPU time (torch.profiler over 10 eager runs): where a part's
    time goes, before choosing what to fuse."""
    from torch.profiler import ProfilerActivity, profile
    for name, fn in parts.items():
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                fn()
            torch.cuda.synchronize()
        print(f"{name} at {n} keys, 10 runs:")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))


def main(argv: list[str] | None = None) -> int:
    def extra(ap: argparse.ArgumentParser) -> None:
        ap.add_argument("--tokens", type=int, default=32, help="the prompt's padded length (a 20-token question: 32)")
        ap.add_argument("--real", type=int, default=20, help="its real tokens (the seed's query is the last)")
        ap.add_argument("--profile", action="store_true", help="also print each part's kernels by GPU time")
    args = gpu_cli("ctxcache bench prefill", "32768,131072", argv, extra, __doc__, batches=False)
    if args is None:
        return 2
    if not 0 < args.real <= args.tokens:
        print(f"ctxcache bench prefill: error: --real {args.real} must be in 1..--tokens ({args.tokens})",
              file=sys.stderr)
        return 2
    params, budget, bandwidth = CSAttentionParams(), Budget(), copy_bandwidth("cuda")
    rows = []
    for n in args.contexts:
        rows.append(bench_one(n, args.tokens, args.real, budget, params, bandwidth, args.profile))
        torch.cuda.empty_cache()
    cols = ["context", "tokens", "floor_us", "sdpa_us", "packed_us", "spans", "speedup", "seed_chain_us", "seed_fused_us",
            "insert_us"]
    print_table(rows, cols)
    print_table(rows, ["context"] + [f"packed{s}_us" for s in SPANS] + ["packed_err", "seed_fused_overlap"])
    print_table(rows, ["context"] + [f"spank{s}_us" for s in SPANS] + ["spank_best_us", "spank_best"])
    path = write_result("prefill", {"copy_bytes_per_s": bandwidth, "rows": rows}, args.out)
    print(f"per-layer question prefill, us (one layer of 32); wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
