"""Per-layer decode attention: dense SDPA (flash) and split-K vs CSAttention selection + sparse attention.

Llama-3.1-8B shapes (32 query heads, 8 KV heads, head_dim 128, bf16), one layer, random
K/V/Q and random tables of the shapes CSAttention builds (m=8, C=128): the list layout
(L = alpha * N; rows cs_*, csattention) and the dense full-list layout, the measured default
(dense_score [B, Hkv, m, C, N], each batch row its own unless --share-tables; rows cs_dense_*, csattention_dense;
*_g16 for fp16 tables, *_g16_int8 for int8 tables with a per-row scale, CSAttention's default
table_dtype, scored by integer dot products).
Each variant is captured in a CUDA graph and timed by replay (median, L2 flushed). The timed
rows run the decoder's own configs (GpuSelector's score and Top-K shapes, GpuSparseAttention's
ATTN_CFG). The launch-shape sweeps that chose those configs were deleted with their probe
(bench/attention_tune.py, git history).
`ctxcache bench attention [--contexts 8192,...] [--batches 1,8] [--out DIR]`."""

from __future__ import annotations

import argparse

import torch

from ctxcache.decoder.gpu.attention import ATTN_CFG
from ctxcache.kernels.rerank import Reranker
from ctxcache.decoder.gpu.selector import GpuSelector
from ctxcache.kernels.topk import radix_topk
from ctxcache.kernels.split_k_attention import choose_splits, region, sparse_decode_attention
from ctxcache.methods import Budget
from ctxcache.methods.csattention import CSAttentionParams

from ctxcache.bench.common.gpu import D, HKV, HQ, batch_dense_tables, gpu_cli, random_tables, sdpa_dense
from ctxcache.kernels.timing import capture_graph as capture, flush_mode, time_us
from ctxcache.bench.common.report import plot_lines, print_table, write_result

# Dense-layout variants, row suffix -> (routing, score keys, table dtype). "" is the first
# layout (a route per query head, fp32 scores, four radix passes); "_g16_int8" the default.
DENSE_VARIANTS = {"": ("head", "fp32", "float16"), "_g": ("group", "fp32", "float16"),
                  "_g16": ("group", "fp16", "float16"), "_g16_int8": ("group", "fp16", "int8")}


def step_inputs(n: int, batch: int, budget: Budget, dev: str) -> tuple[torch.Tensor, ...]:
    """Random (q, k, v) of one decode step over n cached keys, and its lengths and limits
    (n, lo, hi, k per row)."""
    q = torch.randn(batch, HQ, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(batch, HKV, n, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    nt = torch.full((batch,), n, dtype=torch.int32, device=dev)
    lo, hi = region(nt, budget.sinks, budget.recent)
    kk = torch.full((batch,), min(budget.top_k(n), int(hi[0] - lo[0])), dtype=torch.int32, device=dev)
    return q, k, v, nt, lo, hi, kk


def bench_one(n: int, batch: int, params: CSAttentionParams, budget: Budget, dev: str,
              list_layout: bool = False, shared: bool = False, reranks: tuple[float, ...] = ()) -> list[dict]:
    q, k, v, nt, lo, hi, kk = step_inputs(n, batch, budget, dev)
    base = {"context": n, "batch": batch}
    rows = []
    q4 = q[:, :, None]
    _, backend = sdpa_dense(q4, k, v)
    g = capture(lambda: sdpa_dense(q4, k, v))
    rows.append({**base, "method": f"dense_sdpa_{backend}", "time_us": time_us(g.replay)})
    sd = choose_splits(batch * HKV, n)
    g = capture(lambda: sparse_decode_attention(q, k, v, nt, splits=sd))
    rows.append({**base, "method": "dense_splitk", "time_us": time_us(g.replay), "splits": sd})
    if list_layout:
        rows += bench_list(q, k, v, nt, lo, hi, kk, params, budget, base)
    for suffix, variant in DENSE_VARIANTS.items():
        rows += bench_dense(q, k, v, nt, lo, hi, kk, budget, base, suffix, *variant, shared=shared)
    for r in reranks:
        rows += bench_rerank(q, k, v, nt, lo, hi, kk, budget, base, r, shared)
    del k, v
    torch.cuda.empty_cache()
    return rows


def bench_list(q, k, v, nt, lo, hi, kk, params: CSAttentionParams, budget: Budget, base: dict) -> list[dict]:
    """List layout (L = alpha N) selection, broken down, + sparse attention."""
    batch, n = q.shape[0], k.shape[2]
    tables = random_tables(batch, n, params, q.device)
    sel = GpuSelector(params, batch, HQ, HKV, D, n, int(kk[0]), q.device)
    ss = attn_splits(batch, int(kk[0]), budget)
    idx = sel.select(q, tables, lo, hi, kk)
    parts = {
        "select_route_scatter": lambda: sel.route_scatter(q, tables),
        "select_topk": lambda: radix_topk(sel.acc, lo, hi, kk, sel.idx, sel.ws),
        "select": lambda: sel.select(q, tables, lo, hi, kk),
        "sparse_attn": lambda: attend(q, k, v, nt, idx, kk, budget, ss),
    }
    rows = []
    for name, fn in parts.items():
        g = capture(fn)
        rows.append({**base, "method": f"cs_{name}", "time_us": time_us(g.replay)})

    def total():
        attend(q, k, v, nt, sel.select(q, tables, lo, hi, kk), kk, budget, ss)
    g = capture(total)
    rows.append({**base, "method": "csattention", "time_us": time_us(g.replay),
                 "list_len": params.list_length(n), "top_k": int(kk[0]), "splits": ss})
    return rows


def attn_splits(batch: int, top_k: int, budget: Budget, cfg: dict = ATTN_CFG) -> int:
    return choose_splits(batch * HKV, top_k + budget.sinks + budget.recent, min_keys=cfg["min_keys"],
                         waves=cfg["waves"])


def attend(q, k, v, nt, idx, kk, budget: Budget, splits: int, pdl: bool = False, cfg: dict = ATTN_CFG,
           pre_wait: bool = True) -> torch.Tensor:
    """The sparse attention as GpuSparseAttention launches it (ATTN_CFG, or a swept shape)."""
    return sparse_decode_attention(q, k, v, nt, idx, kk, budget.sinks, budget.recent, splits=splits,
                                   block_n=cfg["block_n"], num_warps=cfg["num_warps"],
                                   num_stages=cfg["num_stages"], pdl=pdl, pre_wait=pre_wait)


def bench_dense(q, k, v, nt, lo, hi, kk, budget: Budget, base: dict, suffix: str, routing: str,
                score_keys: str, score_dtype: str, shared: bool = False) -> list[dict]:
    """Dense-layout selection (broken down) + sparse attention, one variant; `shared`: one
    table for every batch row (stride 0) instead of one per row."""
    batch, n = q.shape[0], k.shape[2]
    params = CSAttentionParams(routing=routing, rerank=1.0)  # list_fraction = 1: the dense layout
    tables = batch_dense_tables(batch, n, params, q.device, score_dtype, shared=shared)
    sel = GpuSelector(params, batch, HQ, HKV, D, n, int(kk[0]), q.device, score_keys=score_keys)
    # the selector's own score and Top-K shapes, as the decoder runs them
    ss = attn_splits(batch, int(kk[0]), budget)
    idx = sel.select(q, tables, lo, hi, kk)
    scores = sel.route_dense(q, tables, lo, hi, kk)
    ws_after_pass0 = sel.ws.clone()
    sel.finish(scores, lo, hi, kk)
    routed = HKV if routing == "group" else HQ
    score_bytes = batch * routed * params.subspaces * n * tables.dense_score.element_size()

    def topk_only():  # restore pass 0's histogram (4 KB per row) so replays stay valid
        sel.ws.copy_(ws_after_pass0)
        sel.finish(scores, lo, hi, kk)

    def attn():  # PDL as the decoder launches it (GpuSparseAttention)
        attend(q, k, v, nt, idx, kk, budget, ss, sel.pdl)

    def total():
        attend(q, k, v, nt, sel.select(q, tables, lo, hi, kk), kk, budget, ss, sel.pdl)
    parts = {"cs_dense_score": lambda: sel.route_dense(q, tables, lo, hi, kk), "cs_dense_topk": topk_only,
             "cs_dense_select": lambda: sel.select(q, tables, lo, hi, kk), "csattention_dense": total}
    if suffix == "":
        parts["cs_sparse_attn"] = attn
    rows = []
    for name, fn in parts.items():
        g = capture(fn)
        row = {**base, "method": name + suffix, "time_us": time_us(g.replay), "routing": routing,
               "score_keys": score_keys, "score_dtype": score_dtype, "tables_shared_across_batch_rows": shared}
        if name == "cs_dense_score":
            row["rows_bytes"] = score_bytes  # routed rows of N per KV head (repeats counted)
            row["gb_per_s"] = score_bytes / row["time_us"] / 1e3
        if name == "cs_dense_topk":
            row["note"] = ("Top-K after pass 0 (16-bit keys: pass 1 + collect; fp32: passes 1-3 + collect) "
                           "+ a copy restoring the workspace (4 KB per row + block histograms)")
        if name in ("csattention_dense", "cs_sparse_attn"):
            row.update(top_k=int(kk[0]), splits=ss, dense_cfg=dict(sel.dense_cfg), attn_cfg=dict(ATTN_CFG),
                       topk_block=sel.topk_block, topk_warps=sel.topk_warps)
        rows.append(row)
    del tables, sel, idx
    torch.cuda.empty_cache()
    return rows


def bench_rerank(q, k, v, nt, lo, hi, kk, budget: Budget, base: dict, rerank: float, shared: bool) -> list[dict]:
    """The default variant (group routing, int8 tables) with CSAttention's exact re-rank, as
    GpuSparseAttention runs it: the selector proposes ceil(rerank * K) candidates (the default
    follow: led by the successors of the last step's best keys, seeded here at random positions),
    the Reranker keeps the K best by exact group attention (and records its best for the next
    step), then the sparse attention."""
    batch, n = q.shape[0], k.shape[2]
    params = CSAttentionParams(routing="group", rerank=rerank)
    k_max = int(kk[0])
    kc_max = params.candidates(k_max, int(hi[0] - lo[0]))
    kc = torch.full_like(kk, kc_max)
    tables = batch_dense_tables(batch, n, params, q.device, "int8", shared=shared)
    f = params.follows if kc_max > k_max else 0
    if f:
        span = int(hi[0] - lo[0]) - 1  # distinct previous keys, as a Top-K's are
        tables.follow_prev = (torch.rand(batch, HKV, span, device=q.device).argsort(-1)[..., :f] + int(lo[0])).int()
    kf = kk.clamp(max=f)
    sel = GpuSelector(params, batch, HQ, HKV, D, n, kc_max, q.device, score_keys="fp16")
    ss = attn_splits(batch, k_max, budget)
    cand = sel.select(q, tables, lo, hi, kc)
    rr = Reranker(batch, HKV, HQ // HKV, kc_max, k_max, q.device, follow=f, pdl=sel.pdl)  # as the decoder

    def rerank_only():
        rr(q, k, cand, kc, kk, lo, hi, nt, budget.sinks, budget.recent, tables.follow_prev, kf)

    def total():
        idx = rr(q, k, sel.select(q, tables, lo, hi, kc), kc, kk, lo, hi, nt, budget.sinks, budget.recent,
                 tables.follow_prev, kf)
        attend(q, k, v, nt, idx, kk, budget, ss, sel.pdl)
    tag = f"_rerank{rerank:g}"
    rows = []
    for name, fn in {"cs_dense_select": lambda: sel.select(q, tables, lo, hi, kc), "cs_rerank_only": rerank_only,
                     "csattention_dense": total}.items():
        g = capture(fn)
        rows.append({**base, "method": name + tag, "time_us": time_us(g.replay), "rerank": rerank, "follow": f,
                     "candidates": kc_max, "top_k": k_max, "tables_shared_across_batch_rows": shared})
    del tables, sel, cand
    torch.cuda.empty_cache()
    return rows


def sweep_list_len(n: int, params: CSAttentionParams, budget: Budget, dev: str) -> list[dict]:
    """Selection time at batch 1 for shorter lists (gathered entries per step scale with L)."""
    rows = []
    for alpha in (0.25, 0.125, 0.0625, 0.03125, 0.015625):
        p = CSAttentionParams(list_fraction=alpha, rerank=1.0)
        q = torch.randn(1, HQ, D, device=dev, dtype=torch.bfloat16)
        nt = torch.full((1,), n, dtype=torch.int32, device=dev)
        lo, hi = region(nt, budget.sinks, budget.recent)
        kk = torch.full((1,), budget.top_k(n), dtype=torch.int32, device=dev)
        tables = random_tables(1, n, p, dev)
        sel = GpuSelector(p, 1, HQ, HKV, D, n, int(kk[0]), dev)
        g = capture(lambda: sel.select(q, tables, lo, hi, kk))
        rows.append({"context": n, "batch": 1, "method": f"cs_select_alpha{alpha}",
                     "list_fraction": alpha, "list_len": p.list_length(n), "time_us": time_us(g.replay)})
    return rows


def sweep_topk_block(n: int, budget: Budget, dev: str) -> list[dict]:
    """Radix Top-K alone at batch 1 for several chunk sizes (programs per row = N / block), over
    fp32 scores (four passes) and 16-bit keys (two passes)."""
    x = torch.rand(1, HKV, n, device=dev)
    x16 = torch.randint(0, 1 << 16, (1, HKV, n), dtype=torch.int32, device=dev).to(torch.int16).view(torch.uint16)
    nt = torch.full((1,), n, dtype=torch.int32, device=dev)
    lo, hi = region(nt, budget.sinks, budget.recent)
    kk = torch.full((1,), budget.top_k(n), dtype=torch.int32, device=dev)
    out = torch.zeros(1, HKV, int(kk[0]), dtype=torch.int32, device=dev)
    rows = []
    for block in (1024, 4096, 16384):
        g = capture(lambda: radix_topk(x, lo, hi, kk, out, block=block))
        rows.append({"context": n, "batch": 1, "method": f"topk_block{block}", "time_us": time_us(g.replay)})
        g = capture(lambda: radix_topk(x16, lo, hi, kk, out, block=block))
        rows.append({"context": n, "batch": 1, "method": f"topk16_block{block}", "time_us": time_us(g.replay)})
    k_int = int(kk[0])  # host value outside the captured region
    g = capture(lambda: torch.topk(x[:, :, budget.sinks:n - budget.recent], k_int, dim=-1, sorted=False))
    rows.append({"context": n, "batch": 1, "method": "torch_topk", "time_us": time_us(g.replay)})
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    out = []
    for n, b in sorted({(r["context"], r["batch"]) for r in rows if r["method"].startswith("csattention_dense")}):
        t = {r["method"]: r["time_us"] for r in rows if r["context"] == n and r["batch"] == b}
        dense = next(v for m, v in t.items() if m.startswith("dense_sdpa"))
        row = {"context": n, "batch": b, "sdpa_us": dense, "splitk_us": t["dense_splitk"],
               "attn_us": t.get("cs_sparse_attn")}
        for suffix in DENSE_VARIANTS:
            tag = suffix or "_h32"
            row[f"select{tag}_us"] = t.get(f"cs_dense_select{suffix}")
            row[f"cs{tag}_us"] = t.get(f"csattention_dense{suffix}")
            row[f"speedup{tag}"] = dense / row[f"cs{tag}_us"] if row[f"cs{tag}_us"] else None
        row.update(score_g16_us=t.get("cs_dense_score_g16"), topk_g16_us=t.get("cs_dense_topk_g16"))
        for m, us in t.items():  # the re-rank variants (--rerank)
            if m.startswith("csattention_dense_rerank"):
                tag = m.removeprefix("csattention_dense_")
                row.update({f"cs_{tag}_us": us, f"{tag}_only_us": t.get(f"cs_rerank_only_{tag}"), f"speedup_{tag}": dense / us})
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    def extra(ap: argparse.ArgumentParser) -> None:
        ap.add_argument("--keep", type=float, default=0.05)
        ap.add_argument("--list-layout", action="store_true", help="also time the L = N/4 list layout")
        ap.add_argument("--share-tables", action="store_true",
                        help="one dense table for every batch row (stride 0; rows then hit in L2) instead of one per row")
        ap.add_argument("--rerank", default="4", type=lambda x: tuple(float(r) for r in x.split(",") if r),
                        help="comma-separated re-rank factors to time with the default variant "
                             "(candidates = factor x K; CSAttention's default is 4; '' for none)")
    args = gpu_cli("ctxcache bench attention", "8192,16384,32768,65536,131072", argv, extra, __doc__)
    if args is None:
        return 2
    params, budget = CSAttentionParams(list_fraction=0.25, rerank=1.0), Budget(keep=args.keep)
    n_max = max(args.contexts)
    rows: list[dict] = []
    for b in args.batches:
        for n in args.contexts:
            rows += bench_one(n, b, params, budget, "cuda", args.list_layout, args.share_tables, args.rerank)
            print([(r["method"], round(r["time_us"], 1)) for r in rows if r["context"] == n and r["batch"] == b],
                  flush=True)
    if args.list_layout:
        rows += sweep_list_len(n_max, params, budget, "cuda")
    rows += sweep_topk_block(n_max, budget, "cuda")
    summary = summarize(rows)
    cross = {tag: {b: next((s["context"] for s in summary if s["batch"] == b and (s[f"speedup{tag}"] or 0) > 1), None)
                   for b in args.batches} for tag in ("_h32", "_g16", "_g16_int8")}
    shared = "one table shared by every batch row (stride 0)" if args.share_tables else "each batch row its own tables"
    path = write_result("attention", {
        "tables_shared_across_batch_rows": args.share_tables, "l2_flush": flush_mode(), "keep": args.keep,
        "attn_cfg": ATTN_CFG, "variants": DENSE_VARIANTS, "crossover_context": cross, "summary": summary,
        "rows": rows}, args.out)
    print_table([r for r in rows if r["method"].startswith(("topk", "torch_topk"))],
                ["context", "batch", "method", "time_us"])
    print(f"per-layer decode attention, us; dense tables: {shared}")
    print_table(summary, ["context", "batch", "sdpa_us", "attn_us", "select_h32_us", "cs_h32_us", "speedup_h32",
                          "select_g_us", "cs_g_us", "speedup_g"])
    print_table(summary, ["context", "batch", "sdpa_us", "score_g16_us", "topk_g16_us", "select_g16_us", "cs_g16_us",
                          "speedup_g16", "cs_g16_int8_us", "speedup_g16_int8"])
    for r in args.rerank:
        tag = f"rerank{r:g}"
        print_table(summary, ["context", "batch", "sdpa_us", "cs_g16_int8_us", f"{tag}_only_us", f"cs_{tag}_us",
                              f"speedup_{tag}"])
    png = plot_lines(path.with_suffix(".png"), {
        f"batch {b}": [(s["context"], s["speedup_g16_int8"]) for s in summary if s["batch"] == b and s["speedup_g16_int8"]]
        for b in args.batches}, "context (tokens)", "x SDPA (one layer)", "CSAttention step vs SDPA flash")
    print(f"crossover (first context where CSAttention wins) {cross}; attention cfg {ATTN_CFG}; "
          f"tables {shared}; wrote {path}" + (f", {png}" if png else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
