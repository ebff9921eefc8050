"""End-to-end decode tokens/s of a random-weight Llama-3.1-8B-shaped model, dense vs CSAttention,
both as CUDA-graph-captured steps; plus index build time vs prefill at 32K and the time to first
token from a loaded artifact (ttft_rows).

Memory decides the layer count: 8B bf16 weights are 16 GB and the KV of 128K tokens is 17 GB
per batch row over 32 layers, so batch 8 at 128K (137 GB of KV) cannot run with 32 layers on
one H100; such rows run fewer layers and say so (`layers`). Random list tables are shared by
all layers of a run (`tables_shared_across_layers`): their size (1.6 GB per row and layer at
L = N/4) would not fit otherwise. Dense-layout tables (list_fraction 1.0, the default; 1.1 GB
int8 or 2.1 GB fp16 per row and layer at 128K, 2-4x the KV) are each batch row's own (with
--share-tables: one row's tables seen by every row, stride 0, so rows after the first read them
from L2) and rotate over up to DENSE_BUFFERS distinct buffers across layers, as many as fit in
the free memory (`tables_distinct_buffers`); between two uses of a buffer the other layers read
their weights (0.4 GB a layer) and rows, more than the 50 MB L2, so no layer's rows come from
cache. `ctxcache bench decode [--configs 131072x1x32,...] [--share-tables]`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import torch

from ctxcache.bench.common.gpu import (batch_dense_tables, dense_table_bytes, random_dense_tables, random_model,
                                      random_tables, rows_view)
from ctxcache.bench.common.report import add_out, print_table, write_result
from ctxcache.decoder.gpu.attention import GpuDenseAttention, GpuSparseAttention
from ctxcache.decoder.gpu.capacity import free_bytes
from ctxcache.decoder.gpu.graph import GraphDecoder
from ctxcache.methods.csattention_build import build_tables_gpu_layers
from ctxcache.methods.csattention import GPU_LAYER_GROUP
from ctxcache.methods import Budget
from ctxcache.methods.csattention import CSAttentionParams
from ctxcache.models.attention import dense_attention


def tokens_per_s(model, cache, attn, batch: int, n: int, steps: int) -> float:
    cache.lengths.fill_(n)
    dec = GraphDecoder(model, cache, attn)
    tok = torch.zeros(batch, dtype=torch.long, device="cuda")
    tok = torch.arange(batch, device="cuda")  # distinct rows: equal tokens would route alike
    dec.step(tok)  # capture + first replay
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        dec.step(tok)
    torch.cuda.synchronize()
    return batch * steps / (time.perf_counter() - t0)


def bench_decode(n: int, batch: int, layers: int, params: CSAttentionParams, budget: Budget, steps: int,
                 attn_cfg: dict | None = None, shared: bool = False) -> list[dict]:
    model = random_model(layers, n + steps + 8)
    a = model.args
    cache = model.new_cache(batch, max_len=n + steps + 8)
    for t in (*cache.k, *cache.v):
        t.normal_()
    base = {"context": n, "batch": batch, "layers": layers, "steps": steps}
    rows = [{**base, "method": "dense_splitk_graph",
             "tokens_per_s": tokens_per_s(model, cache, GpuDenseAttention(batch, a.n_kv_heads, cache.max_len),
                                          batch, n, steps)}]
    if params.list_length(n) == n:
        int8 = "_int8" if params.int8_tables else ""
        info = {"method": f"csattention_dense_graph_{params.routing}{int8}", "tables_shared_across_batch_rows": shared}
        free = free_bytes()
        buffers = dense_buffers(batch, n, layers, params, shared, free)
        if buffers == 0:
            need = dense_table_bytes(1 if shared else batch, n, params, _dtype(params)) / 2**30
            print(f"skipped {info['method']} at {n}x{batch}x{layers}: tables of {need:.1f} GiB do not fit", flush=True)
            return rows + [{**base, **info, "skipped": f"tables of {need:.1f} GiB do not fit in the free memory"}]
        tabs = dense_layer_tables(batch, n, layers, params, steps, shared, buffers)
        info.update(tables_distinct_buffers=buffers, tables_rotated_across_layers=buffers > 1)
    else:
        tab = random_tables(batch, n, params, "cuda")
        tab.new_scores = torch.zeros(*tab.new_scores.shape[:4], steps + 8, device="cuda")
        tabs = [tab] * layers
        info = {"method": "csattention_graph", "tables_shared_across_layers": True}
    attn = GpuSparseAttention(params, tabs, budget, batch, a.n_heads, a.n_kv_heads, a.head_dim, cache.max_len,
                              attn_cfg=(attn_cfg or {}).get("attn"))
    attn.selector.dense_cfg.update((attn_cfg or {}).get("dense", {}))
    if (attn_cfg or {}).get("topk16_block") and params.list_length(n) == n:
        attn.selector.set_topk_block(attn_cfg["topk16_block"], attn_cfg.get("topk16_warps") or 4)
    rows.append({**base, **info, "list_len": params.list_length(n), "routing": params.routing,
                 "attn_splits": attn.splits, "attn_block_n": attn.block_n, "dense_cfg": dict(attn.selector.dense_cfg),
                 "topk_block": attn.selector.topk_block,
                 "tokens_per_s": tokens_per_s(model, cache, attn, batch, n, steps)})
    del model, cache, tabs, attn
    torch.cuda.empty_cache()
    return rows


DENSE_BUFFERS = 4
RESERVE = 6 << 30  # bytes left free beside the tables: workspaces, graph pools, the streamed overlays


def _dtype(params: CSAttentionParams) -> str:
    return "int8" if params.int8_tables else "float16"


def dense_buffers(batch: int, n: int, layers: int, params: CSAttentionParams, shared: bool, free: int) -> int:
    """Distinct table buffers to rotate across layers: up to DENSE_BUFFERS (and layers), as many
    as fit in `free` bytes beside RESERVE; 0 where not even one fits."""
    per_buffer = dense_table_bytes(1 if shared else batch, n, params, _dtype(params))
    return max(0, min(DENSE_BUFFERS, layers, (free - RESERVE) // per_buffer))


def dense_layer_tables(batch: int, n: int, layers: int, params: CSAttentionParams, steps: int,
                       shared: bool = False, buffers: int = DENSE_BUFFERS, device: str = "cuda") -> list:
    """Per-layer dense tables: `buffers` distinct tables of `batch` rows (each row its own, or
    with `shared` one row's seen by all, stride 0) rotated across layers; each layer keeps its
    own streamed overlay."""
    bufs = [batch_dense_tables(batch, n, params, device, _dtype(params), shared=shared)
            for _ in range(min(buffers, layers))]
    return [rows_view(bufs[layer % len(bufs)], batch, steps + 8) for layer in range(layers)]


class _GpuCapture:
    """Dense prefill attention that keeps each layer's queries on the GPU (bf16)."""

    def __init__(self, layers: int) -> None:
        self.chunks = [[] for _ in range(layers)]

    def __call__(self, layer, q, cache, pos):
        self.chunks[layer].append(q[0])
        return dense_attention(layer, q, cache, pos)


@torch.inference_mode()
def bench_build(n: int, variants: list[CSAttentionParams], chunk: int = 4096) -> list[dict]:
    """Prefill of n tokens (plain, and keeping every layer's queries), then the GPU table build
    of all 32 layers for each parameter set (kernels.kmeans.build_tables_gpu_layers, what the indexer
    runs on a GPU, GPU_LAYER_GROUP layers per k-means; tables stay on the device, their copy to
    the host is not timed)."""
    model = random_model(32, n + 8)
    cache = model.new_cache(1, max_len=n)
    tokens = torch.randint(0, model.args.vocab_size, (1, n), device="cuda")
    times = {}
    model(tokens[:, :chunk], torch.arange(chunk, device="cuda")[None], cache,
          lambda l, q, c, p: dense_attention(l, q, c, p), last_only=True)  # warm-up (kernel selection)
    for name, attn in (("prefill", lambda l, q, c, p: dense_attention(l, q, c, p)), ("prefill_capture", _GpuCapture(32))):
        cache.lengths.zero_()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for s in range(0, n, chunk):
            pos = cache.lengths[:, None] + torch.arange(chunk, device="cuda")
            model(tokens[:, s:s + chunk], pos, cache, attn, last_only=True)
            cache.lengths += chunk
        torch.cuda.synchronize()
        times[name] = time.perf_counter() - t0
    qs = [torch.cat(attn.chunks[layer], dim=1) for layer in range(32)]
    attn.chunks = []
    base = {"context": n, "batch": 1, "layers": 32}
    rows = [{**base, "method": k, "time_us": v * 1e6} for k, v in times.items()]
    ks = [cache.k[layer][0, :, :n] for layer in range(32)]
    for params in variants:
        build_tables_gpu_layers(params, qs[:1], ks[:1])  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for first in range(0, 32, GPU_LAYER_GROUP):  # as the indexer groups layers
            build_tables_gpu_layers(params, qs[first:first + GPU_LAYER_GROUP], ks[first:first + GPU_LAYER_GROUP])
        torch.cuda.synchronize()
        build = time.perf_counter() - t0
        tag = {"routing": params.routing, "list_fraction": params.list_fraction}
        rows += [{**base, **tag, "method": f"build_{params.routing}", "time_us": build * 1e6},
                 {**base, **tag, "method": f"build_over_prefill_{params.routing}", "ratio": build / times["prefill"]},
                 {**base, **tag, "method": f"build_over_prefill_with_capture_{params.routing}",
                  "ratio": build / times["prefill_capture"]}]
    del model, cache, qs, ks
    torch.cuda.empty_cache()
    return rows


# Time to first token from a loaded artifact (--ttft-context). The artifact (each layer's K/V and
# dense CSAttention tables, the default layout) sits in pinned host memory, as the decoder holds
# one loaded from the store; timed from DRAM to the first generated token (copy K/V and tables
# to the GPU, prefill the question over the cached context, argmax of the last logits), beside
# the question over an artifact already on the GPU (hot) and re-prefilling context + question.
# One pinned source buffer serves every layer's copy: the bytes moved over PCIe are the same as
# from 32 distinct ones (4x fewer host GB to pin).


def _seconds(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


@torch.inference_mode()
def ttft_rows(n: int, question: int = 32, layers: int = 32, repeats: int = 3) -> list[dict]:
    model = random_model(layers, n + question + 8)
    a, params, budget = model.args, CSAttentionParams(rerank=1.0), Budget()
    cache = model.new_cache(1, max_len=n + question + 8)
    tables = [random_dense_tables(1, n, params, "cuda", max_new=question + 8) for _ in range(layers)]
    host_k = torch.randn(a.n_kv_heads, n, a.head_dim, dtype=torch.bfloat16).pin_memory()
    host_v = torch.randn_like(host_k).pin_memory()
    host_t = tables[0].dense_score[0].cpu().pin_memory()
    tokens = torch.randint(0, a.vocab_size, (1, n + question), device="cuda")
    q_pos = torch.arange(n, n + question, device="cuda")[None]

    def load() -> None:
        for layer in range(layers):
            cache.k[layer][0, :, :n].copy_(host_k, non_blocking=True)
            cache.v[layer][0, :, :n].copy_(host_v, non_blocking=True)
            tables[layer].dense_score[0].copy_(host_t, non_blocking=True)

    attn = GpuSparseAttention(params, tables, budget, 1, a.n_heads, a.n_kv_heads, a.head_dim, cache.max_len)

    def answer_first_token() -> torch.Tensor:
        for t in tables:  # a fresh request: no streamed keys yet
            t.stream_count.zero_()
        return model(tokens[:, n:], q_pos, cache, attn, last_only=True)[:, -1].argmax(-1)

    def reprefill() -> torch.Tensor:
        chunk = 4096
        for s in range(0, n + question, chunk):
            e = min(s + chunk, n + question)
            logits = model(tokens[:, s:e], torch.arange(s, e, device="cuda")[None], cache,
                           lambda l, q, c, p: dense_attention(l, q, c, p), last_only=True)
        return logits[:, -1].argmax(-1)

    answer_first_token()  # warm-up (kernel compiles, cuBLAS handles)
    load_s = min(_seconds(load) for _ in range(repeats))
    cold = min(_seconds(lambda: (load(), answer_first_token())) for _ in range(repeats))
    hot = min(_seconds(answer_first_token) for _ in range(repeats))
    full = min(_seconds(reprefill) for _ in range(repeats))
    moved = layers * (host_k.numel() * 2 * 2 + host_t.numel() * 2)
    base = {"context": n, "batch": 1, "layers": layers, "question_tokens": question}
    return [{**base, "method": "ttft_from_host_artifact", "time_us": cold * 1e6, "bytes_moved": moved,
             "load_us": load_s * 1e6, "load_gb_per_s": moved / load_s / 1e9},
            {**base, "method": "ttft_artifact_on_gpu", "time_us": hot * 1e6},
            {**base, "method": "ttft_reprefill_dense", "time_us": full * 1e6}]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ctxcache bench decode", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="131072x1x32,131072x8x8,32768x1x32,32768x8x32",
                    help="context x batch x layers, comma separated")
    ap.add_argument("--list-fractions", default="1.0", help="1.0: the dense layout; e.g. 0.25,0.015625,1.0")
    ap.add_argument("--routings", default="head,group", help="CSAttention routing variants (dense layout)")
    ap.add_argument("--table-dtypes", default="int8,float16", help="dense tables' storage (int8: the default)")
    ap.add_argument("--attn-cfg", default=None, type=json.loads,
                    help='launch configs to try instead of the decoder\'s, as JSON {"attn": .., "dense": .., '
                         '"topk16_block": .., "topk16_warps": ..}')
    ap.add_argument("--share-tables", action="store_true",
                    help="one dense table for every batch row (stride 0; rows then hit in L2) instead of one per row")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--build-context", type=int, default=32768)
    ap.add_argument("--ttft-context", type=int, default=32768, help="time to first token from a loaded artifact (0: skip)")
    add_out(ap)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("ctxcache bench decode: error: needs a CUDA GPU", file=sys.stderr)
        return 2
    budget, rows = Budget(), []
    attn_cfg = args.attn_cfg
    variants = [(float(a), r, dt) for a in args.list_fractions.split(",")
                for r in (args.routings.split(",") if float(a) == 1.0 else ["head"])
                for dt in (args.table_dtypes.split(",") if float(a) == 1.0 else ["float16"])]
    for cfg in filter(None, args.configs.split(",")):  # "" runs only the build / TTFT parts
        n, b, layers = (int(x) for x in cfg.split("x"))
        for i, (alpha, routing, dtype) in enumerate(variants):
            params = CSAttentionParams(list_fraction=alpha, routing=routing, table_dtype=dtype, rerank=1.0)
            got = bench_decode(n, b, layers, params, budget, args.steps, attn_cfg, args.share_tables)
            rows += got if i == 0 else got[1:]  # the dense baseline once per config
            for r in got:
                r["list_fraction"] = alpha
            print(got, flush=True)
    if args.build_context:
        rows += bench_build(args.build_context, [CSAttentionParams(routing=r, rerank=1.0) for r in args.routings.split(",")])
    if args.ttft_context:
        rows += ttft_rows(args.ttft_context)
        print(rows[-3:], flush=True)
    path = write_result("decode", {"tables_shared_across_batch_rows": args.share_tables,
                                   "budget": dataclasses.asdict(budget), "attn_cfg": attn_cfg, "rows": rows}, args.out)
    shared = "one table shared by every batch row (stride 0)" if args.share_tables else "each batch row its own tables"
    print(f"decode tokens/s and build/TTFT times; dense tables: {shared}")
    print_table(rows, ["context", "batch", "layers", "method", "list_fraction", "tokens_per_s", "time_us", "ratio",
                       "tables_distinct_buffers", "skipped"])
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
