"""CPU<->GPU mode: decode attention over host-resident KV, vs dense on the GPU and dense over the host.

Llama-3.1-8B shapes (32 query heads, 8 KV heads, head_dim 128, bf16). Per layer, in one process:
  dense_gpu_sdpa      SDPA flash, KV in HBM (the all-GPU baseline);
  csattention_gpu     GPU selection + sparse attention, KV in HBM (for reference);
  dense_host_zerocopy split-K dense attention reading all K/V from pinned host memory;
  dense_host_copy     each layer's K/V copied H2D on a side stream (double-buffered, events)
                      while SDPA runs on the previous layer: the pipelined steady state;
  offload_rho*        CSAttention over host KV: GPU selection (list layout, list_fraction 1/64,
                      random tables shared by the layers), slot plan, zero-copy attention with
                      a GPU cache of one selection per layer (keep x the KV) - only misses
                      cross PCIe. Queries follow q <- rho q + sqrt(1 - rho^2) noise each step:
                      rho 0 is the worst case for the cache (independent queries); the hit rate
                      at rho > 0 is a synthetic stand-in for a real model's step-to-step overlap.
Host K/V rotate over `--host-layers` distinct buffers so no layer's reads come from L2.
tokens/s = batch / (32 x per-layer attention time + non-attention time), the latter measured
from a random-weight Llama-3.1-8B decode step (CUDA graph) whose attention returns q.
`ctxcache bench offload [--contexts 131072,32768] [--batches 1,8] [--rhos 0,0.9]`."""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time

import torch

from ctxcache.bench.common.gpu import D, HKV, HQ, positive_ints, random_model, random_tables, sdpa_dense
from ctxcache.kernels.timing import capture_graph as capture, flush_mode, time_us
from ctxcache.bench.common.report import add_out, print_table, write_result
from ctxcache.host_copy import pinned_exact
from ctxcache.decoder.gpu.offload import OffloadAttention, plan_slots
from ctxcache.decoder.gpu.selector import GpuSelector
from ctxcache.kernels.split_k_attention import choose_splits, region, sparse_decode_attention
from ctxcache.methods import Budget
from ctxcache.methods.csattention import CSAttentionParams

LAYERS = 32


def host_kv(batch: int, n: int) -> torch.Tensor:
    """Pinned [B, Hkv, n, D] bf16 filled with N(0, 1) made on the GPU (CPU randn of GBs is slow)."""
    t = pinned_exact((batch, HKV, n, D), torch.bfloat16)
    for b in range(batch):
        t[b].copy_(torch.randn(HKV, n, D, device="cuda", dtype=torch.bfloat16))
    return t


def non_attention_us(batches: list[int], steps: int = 20) -> dict[int, float]:
    """Decode step time per batch size of a random-weight 32-layer Llama-3.1-8B (CUDA graph)
    whose attention returns q: weights, norms, projections, MLP, lm_head, KV write."""
    from ctxcache.decoder.gpu.graph import GraphDecoder
    model = random_model(LAYERS, 64)
    out = {}
    for batch in batches:
        cache = model.new_cache(batch, max_len=64)
        dec = GraphDecoder(model, cache, lambda layer, q, c, pos: q)
        tok = torch.arange(batch, device="cuda")
        dec.step(tok)
        cache.lengths.zero_()
        dec.lengths_changed()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            dec.step(tok)
        torch.cuda.synchronize()
        out[batch] = (time.perf_counter() - t0) / steps * 1e6
        del cache, dec
    del model
    torch.cuda.empty_cache()
    return out


def pipelined_copy_sdpa_us(q4: torch.Tensor, kh: list[torch.Tensor], vh: list[torch.Tensor], iters: int) -> float:
    """Per-layer time of: copy layer i's K/V H2D on a side stream into one of two GPU buffers
    while SDPA runs on layer i-1; events order the reuse of each buffer."""
    main, side = torch.cuda.current_stream(), torch.cuda.Stream()
    bufs = [(torch.empty_like(kh[0], device="cuda"), torch.empty_like(vh[0], device="cuda")) for _ in range(2)]
    copied = [torch.cuda.Event() for _ in range(2)]
    freed = [torch.cuda.Event() for _ in range(2)]
    for e in freed:
        e.record(main)

    def run(count: int) -> None:
        for i in range(count):
            j = i % 2
            with torch.cuda.stream(side):
                side.wait_event(freed[j])
                bufs[j][0].copy_(kh[i % len(kh)], non_blocking=True)
                bufs[j][1].copy_(vh[i % len(vh)], non_blocking=True)
                copied[j].record(side)
            main.wait_event(copied[j])
            sdpa_dense(q4, bufs[j][0], bufs[j][1])
            freed[j].record(main)
    run(2)  # warm-up
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(main)
    run(iters)
    end.record(main)
    torch.cuda.synchronize()
    del bufs
    return start.elapsed_time(end) * 1000 / iters


def bench_context(n: int, batch: int, host_layers: int, rhos: list[float], params: CSAttentionParams,
                  budget: Budget) -> list[dict]:
    base = {"context": n, "batch": batch}
    rows = []
    kv_bytes_layer = 2 * batch * HKV * n * D * 2
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
    q4 = q[:, :, None]
    nt = torch.full((batch,), n, dtype=torch.int32, device="cuda")
    lo, hi = region(nt, budget.sinks, budget.recent)
    k_max = min(budget.top_k(n), int(hi[0] - lo[0]))
    kk = torch.full((batch,), k_max, dtype=torch.int32, device="cuda")
    tables = random_tables(batch, n, params, "cuda")
    sel = GpuSelector(params, batch, HQ, HKV, D, n, k_max, "cuda")

    # KV in HBM: dense SDPA and CSAttention
    kg = torch.randn(batch, HKV, n, D, device="cuda", dtype=torch.bfloat16)
    vg = torch.randn_like(kg)
    _, backend = sdpa_dense(q4, kg, vg)
    rows.append({**base, "method": f"dense_gpu_sdpa_{backend}", "time_us": time_us(capture(lambda: sdpa_dense(q4, kg, vg)).replay),
                 "gpu_kv_fraction": 1.0})
    ss = choose_splits(batch * HKV, k_max + budget.sinks + budget.recent)

    def cs_gpu():
        i = sel.select(q, tables, lo, hi, kk)
        sparse_decode_attention(q, kg, vg, nt, i, kk, budget.sinks, budget.recent, splits=ss)
    rows.append({**base, "method": "csattention_gpu", "time_us": time_us(capture(cs_gpu).replay), "gpu_kv_fraction": 1.0})
    rows.append({**base, "method": "cs_select_gpu", "time_us": time_us(capture(lambda: sel.select(q, tables, lo, hi, kk)).replay)})
    del kg, vg
    torch.cuda.empty_cache()

    # KV in pinned host memory
    t0 = time.perf_counter()
    kh = [host_kv(batch, n) for _ in range(host_layers)]
    vh = [host_kv(batch, n) for _ in range(host_layers)]
    print(f"pinned {2 * host_layers * kh[0].nbytes / 2**30:.1f} GiB in {time.perf_counter() - t0:.1f} s", flush=True)
    sd = choose_splits(batch * HKV, n)

    def dense_zero_copy():
        for i in range(host_layers):
            sparse_decode_attention(q, kh[i], vh[i], nt, splits=sd)
    t = time_us(capture(dense_zero_copy).replay, rep_ms=200) / host_layers
    rows.append({**base, "method": "dense_host_zerocopy", "time_us": t, "gpu_kv_fraction": 0.0,
                 "pcie_gb_per_s": kv_bytes_layer / t / 1e3})
    t = pipelined_copy_sdpa_us(q4, kh, vh, iters=max(4, 2 * host_layers))
    rows.append({**base, "method": "dense_host_copy", "time_us": t, "gpu_kv_fraction": 2 / LAYERS,
                 "pcie_gb_per_s": kv_bytes_layer / t / 1e3,
                 "note": "two layers' K/V staged in HBM (double buffer): gpu_kv_fraction = 2/32"})

    for rho in rhos:
        attn = OffloadAttention(sel, [tables] * host_layers, kh, vh, budget.sinks, budget.recent, budget.keep, k_max)
        a, c = rho, math.sqrt(max(0.0, 1.0 - rho * rho))

        def step():
            for i in range(host_layers):
                q.mul_(a).add_(torch.randn_like(q), alpha=c)  # next step's query (graph-safe RNG)
                attn(i, q, nt)
        # zero-copy reads are latency-bound: more splits keep more PCIe requests in flight, so
        # sweep the split count (same run) and report the best as offload_rho*
        found = []
        s0 = attn.splits
        for splits in sorted({s0, min(256, 2 * s0), min(256, 4 * s0)}):
            attn.splits = splits
            g = capture(step, warmup=3)
            attn.reset_counts()
            t = time_us(g.replay, rep_ms=200) / host_layers
            found.append((t, splits, attn.hit_rate()))
            del g
        t, splits, hit = min(found)
        moved = 2 * batch * HKV * D * 2 * ((1 - hit) * k_max + budget.sinks + budget.recent)
        rows.append({**base, "method": f"offload_rho{rho:g}", "time_us": t, "rho": rho, "cache_hit_rate": hit,
                     "top_k": k_max, "list_len": params.list_length(n), "splits": splits,
                     "splits_sweep_us": {str(sp): tt for tt, sp, _ in found},
                     "gpu_kv_fraction": attn.caches[0].nbytes() / kv_bytes_layer,
                     "gpu_table_bytes_per_layer": sum(x.nbytes for x in (tables.list_idx, tables.list_score, tables.centroids,
                                                                          tables.list_floor)),
                     "host_bytes_read_per_layer": moved, "pcie_gb_per_s": moved / t / 1e3})

        def select_plan():  # the GPU-side part alone: selection + slot plan (no host reads)
            for i in range(host_layers):
                q.mul_(a).add_(torch.randn_like(q), alpha=c)
                lo_, hi_, k_ = attn.limits(nt)
                plan_slots(attn.caches[i], sel.select(q, tables, lo_, hi_, k_), k_)
        g = capture(select_plan)
        rows.append({**base, "method": f"offload_select_plan_rho{rho:g}",
                     "time_us": time_us(g.replay) / host_layers})
        del attn, g
        torch.cuda.empty_cache()
    del kh, vh, tables, sel
    return rows


def add_tokens_per_s(rows: list[dict], non_attn: dict[int, float]) -> None:
    for r in rows:
        if "time_us" in r and not r["method"].startswith(("cs_select", "offload_select")):
            step = LAYERS * r["time_us"] + non_attn[r["batch"]]
            r["non_attention_us"] = non_attn[r["batch"]]
            r["tokens_per_s"] = r["batch"] * 1e6 / step


def summarize(rows: list[dict]) -> list[dict]:
    out = []
    for n, b in sorted({(r["context"], r["batch"]) for r in rows}):
        t = {r["method"]: r for r in rows if r["context"] == n and r["batch"] == b and "tokens_per_s" in r}
        host = max(t["dense_host_zerocopy"]["tokens_per_s"], t["dense_host_copy"]["tokens_per_s"])
        gpu = next(v["tokens_per_s"] for m, v in t.items() if m.startswith("dense_gpu"))
        for m, r in t.items():
            if m.startswith("offload_rho"):
                out.append({"context": n, "batch": b, "method": m, "tokens_per_s": r["tokens_per_s"],
                            "vs_dense_host": r["tokens_per_s"] / host, "vs_dense_gpu": r["tokens_per_s"] / gpu,
                            "hit_rate": r["cache_hit_rate"], "gpu_kv_fraction": r["gpu_kv_fraction"],
                            "dense_host_tok_s": host, "dense_gpu_tok_s": gpu})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ctxcache bench offload", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="131072,32768", type=positive_ints)
    ap.add_argument("--batches", default="1,8", type=positive_ints)
    ap.add_argument("--rhos", default="0,0.9")
    ap.add_argument("--list-fraction", type=float, default=1 / 64)
    ap.add_argument("--host-layers", type=int, default=4)
    add_out(ap)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("ctxcache bench offload: error: needs a CUDA GPU", file=sys.stderr)
        return 2
    # routing="head": the configuration measured in bench/README.md (before group routing was the default)
    params, budget = CSAttentionParams(list_fraction=args.list_fraction, routing="head", rerank=1.0), Budget()
    batches = args.batches
    non_attn = non_attention_us(batches)
    print("non-attention step us", non_attn, flush=True)
    rows = []
    for b in batches:
        for n in args.contexts:
            layers = args.host_layers if b == 1 else 2  # batch 8 x 128K: 4.3 GB of K+V per layer
            got = bench_context(n, b, layers, [float(x) for x in args.rhos.split(",")], params, budget)
            for r in got:
                print(r, flush=True)
            rows += got
    add_tokens_per_s(rows, non_attn)
    summary = summarize(rows)
    path = write_result("offload", {"l2_flush": flush_mode(), "layers": LAYERS, "params": params.to_dict(),
                                    "budget": dataclasses.asdict(budget), "non_attention_us": non_attn,
                                    "summary": summary, "rows": rows}, args.out)
    print_table(rows, ["context", "batch", "method", "time_us", "tokens_per_s", "cache_hit_rate", "gpu_kv_fraction"])
    print_table(summary, ["context", "batch", "method", "tokens_per_s", "vs_dense_host", "vs_dense_gpu", "hit_rate",
                          "gpu_kv_fraction"])
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
