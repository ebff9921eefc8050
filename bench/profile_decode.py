"""Where an end-to-end decode step's GPU time goes: the kernels of a few CUDA-graph replays of
`bench decode`'s random-weight model (dense split-K and CSAttention), from the torch profiler,
grouped by kernel name.
`ctxcache bench profile_decode [--contexts 131072] [--batches 8] [--layers 8] [--steps 8] [--out DIR]`."""

from __future__ import annotations

import argparse
import time

import torch

from ctxcache.bench.decode import dense_layer_tables, random_model
from ctxcache.bench.gpu_inputs import gpu_cli, grid_points
from ctxcache.decoder.gpu.attention import GpuDenseAttention, GpuSparseAttention
from ctxcache.decoder.gpu.graph import GraphDecoder
from ctxcache.decoder.gpu.timing import print_table, write_results
from ctxcache.methods import Budget
from ctxcache.methods.csattention import CSAttentionParams


def kernel_times(dec: GraphDecoder, tok: torch.Tensor, steps: int) -> list[dict]:
    """Per kernel name: calls and GPU µs per step over `steps` replays; first row: wall µs per
    step without the profiler (host loop included)."""
    dec.step(tok)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        dec.step(tok)
    torch.cuda.synchronize()
    wall = {"kernel": "(wall per step)", "calls_per_step": 1.0, "us_per_step": (time.perf_counter() - t0) * 1e6 / steps}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            dec.step(tok)
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", 0.0) or getattr(e, "cuda_time_total", 0.0)
        if us > 0:
            rows.append({"kernel": e.key[:60], "calls_per_step": e.count / steps, "us_per_step": us / steps})
    return [wall] + sorted(rows, key=lambda r: -r["us_per_step"])


def profile(n: int, b: int, layers: int, steps: int) -> list[dict]:
    """Kernel rows of the dense and the CSAttention decode step at context n, batch b."""
    model = random_model(layers, n + 2 * steps + 8)
    a = model.args
    cache = model.new_cache(b, max_len=n + 2 * steps + 8)
    for t in (*cache.k, *cache.v):
        t.normal_()
    tok = torch.arange(b, device="cuda")
    params, budget = CSAttentionParams(), Budget()
    out = []
    for name in ("dense", "csattention"):
        cache.lengths.fill_(n)
        if name == "dense":
            attn = GpuDenseAttention(b, a.n_kv_heads, cache.max_len)
        else:
            tabs = dense_layer_tables(b, n, layers, params, 2 * steps + 8)
            attn = GpuSparseAttention(params, tabs, budget, b, a.n_heads, a.n_kv_heads, a.head_dim, cache.max_len)
        rows = kernel_times(GraphDecoder(model, cache, attn), tok, steps)
        total = sum(r["us_per_step"] for r in rows[1:])
        print(f"{name}: {total:.0f} us of kernels per step ({layers} layers, batch {b}, context {n})")
        print_table(rows[:25], ["kernel", "calls_per_step", "us_per_step"])
        out += [{"context": n, "batch": b, "layers": layers, "method": name, **r} for r in rows]
    return out


def main(argv: list[str] | None = None) -> int:
    def extra(ap: argparse.ArgumentParser) -> None:
        ap.add_argument("--layers", type=int, default=8)
        ap.add_argument("--steps", type=int, default=8)
    args = gpu_cli("ctxcache bench profile_decode", "131072", argv, extra)
    if args is None:
        return 2
    rows = []
    for b, n in grid_points(args):
        rows += profile(n, b, args.layers, args.steps)
    write_results("profile_decode", rows, {"steps": args.steps}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
