"""End-to-end decode tokens/s of a random-weight Llama-3.1-8B-shaped model, dense vs CSAttention,
both as CUDA-graph-captured steps; plus index build time vs prefill at 32K and the time to first
token from a loaded artifact (bench/ttft.py).

Memory decides the layer count: 8B bf16 weights are 16 GB and the KV of 128K tokens is 17 GB
per batch row over 32 layers, so batch 8 at 128K (137 GB of KV) cannot run with 32 layers on
one H100; such rows run fewer layers and say so (`layers`). Random list tables are shared by
all layers of a run (`tables_shared_across_layers`): their size (1.6 GB per row and layer at
L = N/4) would not fit otherwise. Dense-layout tables (list_fraction 1.0, the default; 2.1 GB
per layer at 128K, 4x the KV) are one table per batch (shared by the rows, stride 0) and
rotate over DENSE_BUFFERS distinct buffers across layers: between two uses of a buffer the
other layers read at least 3 x 64 MB of routed rows, more than the 50 MB L2, so no layer's
rows come from cache. `ctxcache bench decode [--configs 131072x1x32,...]`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from ctxcache.bench.gpu_inputs import random_dense_tables, random_tables
from ctxcache.decoder.gpu.attention import GpuDenseAttention, GpuSparseAttention
from ctxcache.decoder.gpu.graph import GraphDecoder
from ctxcache.decoder.gpu.timing import device_info, print_table, write_results
from ctxcache.kernels.kmeans import build_tables_gpu_layers
from ctxcache.indexer.build import GPU_LAYER_GROUP
from ctxcache.methods import Budget
from ctxcache.methods.csattention import CSAttentionParams
from ctxcache.models.attention import dense_attention
from ctxcache.models.config import NAMED_CONFIGS
from ctxcache.models.llama import Transformer


def random_model(layers: int, max_len: int) -> Transformer:
    args = dataclasses.replace(NAMED_CONFIGS["llama-3.1-8b"], n_layers=layers, max_seq_len=max_len)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Transformer(args).to(torch.bfloat16)
    for p in model.parameters():
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=0.02)
    return model.cuda().eval().requires_grad_(False)  # rope_table is built on the CPU


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
                 attn_cfg: dict | None = None) -> list[dict]:
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
        tabs = dense_layer_tables(batch, n, layers, params, steps)
        int8 = "_int8" if params.int8_tables else ""
        info = {"method": f"csattention_dense_graph_{params.routing}{int8}", "tables_shared_across_batch_rows": True,
                "tables_distinct_buffers": min(DENSE_BUFFERS, layers), "tables_rotated_across_layers": True}
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


def dense_layer_tables(batch: int, n: int, layers: int, params: CSAttentionParams, steps: int) -> list:
    """Per-layer dense tables: DENSE_BUFFERS distinct [1, ...] tables expanded over the batch
    (stride 0) and rotated across layers; each layer keeps its own streamed overlay."""
    dtype = "int8" if params.int8_tables else "float16"
    bufs = [random_dense_tables(1, n, params, "cuda", dtype) for _ in range(min(DENSE_BUFFERS, layers))]
    out = []
    for layer in range(layers):
        src = bufs[layer % len(bufs)]
        out.append(dataclasses.replace(
            src, centroids=src.centroids.expand(batch, *src.centroids.shape[1:]),
            dense_score=src.dense_score.expand(batch, *src.dense_score.shape[1:]),
            score_scale=None if src.score_scale is None else src.score_scale.expand(batch, *src.score_scale.shape[1:]),
            n_ctx=torch.full((batch,), n, dtype=torch.int32, device="cuda"),
            new_scores=torch.zeros(batch, *src.new_scores.shape[1:4], steps + 8, device="cuda"),
            stream_start=torch.full((batch,), n, dtype=torch.int32, device="cuda"),
            stream_count=torch.zeros(batch, dtype=torch.int32, device="cuda")))
    return out


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ctxcache bench decode")
    ap.add_argument("--configs", default="131072x1x32,131072x8x8,32768x1x32,32768x8x32",
                    help="context x batch x layers, comma separated")
    ap.add_argument("--list-fractions", default="1.0", help="1.0: the dense layout; e.g. 0.25,0.015625,1.0")
    ap.add_argument("--routings", default="head,group", help="CSAttention routing variants (dense layout)")
    ap.add_argument("--table-dtypes", default="int8,float16", help="dense tables' storage (int8: the default)")
    ap.add_argument("--attn-cfg", default=None,
                    help='tuned configs as JSON {"attn": .., "dense": .., "topk16_block": ..}, or a path to an '
                         'attention bench JSON (its attn_cfg, dense_cfg, topk16_block)')
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--build-context", type=int, default=32768)
    ap.add_argument("--ttft-context", type=int, default=32768, help="time to first token from a loaded artifact (0: skip)")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench decode needs a CUDA GPU")
        return 2
    budget, rows = Budget(), []
    attn_cfg = None
    if args.attn_cfg:
        if args.attn_cfg.lstrip().startswith("{"):
            attn_cfg = json.loads(args.attn_cfg)
        else:
            tuned = json.loads(Path(args.attn_cfg).read_text())
            attn_cfg = {"attn": tuned["attn_cfg"], "dense": tuned["dense_cfg"], "topk16_block": tuned.get("topk16_block"),
                        "topk16_warps": tuned.get("topk16_warps")}
    variants = [(float(a), r, dt) for a in args.list_fractions.split(",")
                for r in (args.routings.split(",") if float(a) == 1.0 else ["head"])
                for dt in (args.table_dtypes.split(",") if float(a) == 1.0 else ["float16"])]
    for cfg in filter(None, args.configs.split(",")):  # "" runs only the build / TTFT parts
        n, b, layers = (int(x) for x in cfg.split("x"))
        for i, (alpha, routing, dtype) in enumerate(variants):
            params = CSAttentionParams(list_fraction=alpha, routing=routing, table_dtype=dtype)
            got = bench_decode(n, b, layers, params, budget, args.steps, attn_cfg)
            rows += got if i == 0 else got[1:]  # the dense baseline once per config
            for r in got:
                r["list_fraction"] = alpha
            print(got, flush=True)
    if args.build_context:
        rows += bench_build(args.build_context, [CSAttentionParams(routing=r) for r in args.routings.split(",")])
    if args.ttft_context:
        from ctxcache.bench.ttft import ttft_rows
        rows += ttft_rows(args.ttft_context)
        print(rows[-3:], flush=True)
    path = write_results("decode", rows, {"budget": dataclasses.asdict(budget), "attn_cfg": attn_cfg}, args.out)
    print_table(rows, ["context", "batch", "layers", "method", "list_fraction", "tokens_per_s", "time_us", "ratio"])
    print(f"device {device_info()['name']}; wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
