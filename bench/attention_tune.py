"""Tuning sweeps of `ctxcache bench attention`. Their picks are recorded only: the timed rows run
the decoder's own configs (GpuSelector's score and Top-K shapes, GpuSparseAttention's ATTN_CFG),
so the bench times what a decode step runs.

The dicts below hold the picks (module state, read by bench/attention.py) and are recorded in
the result JSON; where a pick measured better on the H100 in the whole step (bench step_probe),
it became GpuSelector's / ATTN_CFG's default."""

from __future__ import annotations

import torch

from ctxcache.decoder.gpu.selector import GpuSelector
from ctxcache.decoder.gpu.timing import capture, time_us
from ctxcache.kernels.sparse_attention import choose_splits, region, sparse_decode_attention
from ctxcache.kernels.topk import radix_topk
from ctxcache.methods import Budget
from ctxcache.methods.csattention import CSAttentionParams

from ctxcache.bench.gpu_inputs import D, HKV, HQ, random_dense_tables

# Dense-layout variants, row suffix -> (routing, score keys, table dtype). "" is the earlier
# default (a route per query head, fp32 scores, four radix passes); "_g16" the default now.
DENSE_VARIANTS = {"": ("head", "fp32", "float16"), "_g": ("group", "fp32", "float16"),
                  "_g16": ("group", "fp16", "float16"), "_g16_int8": ("group", "fp16", "int8")}
DENSE_CFG = {"block": 1024, "r_chunk": 8, "num_warps": 4}  # tune_dense's pick
ATTN_PICK = {"waves": 2, "min_keys": 128, "block_n": 64}  # tune_attention's pick
TOPK16_BLOCK = {"block": None, "num_warps": 4}  # tune_topk16's pick (block None: not tuned yet)


# (block, warps, register cap): ncu saw the score kernel at 126 registers and 25% occupancy
SCORE_SWEEP = [(1024, 4, None), (1024, 4, 64), (1024, 4, 80), (1024, 8, None), (1024, 8, 64), (1024, 8, 80),
               (1024, 8, 96), (4096, 8, None), (2048, 16, None)]


def tune_dense(n: int, batches: list[int], budget: Budget, dev: str) -> list[dict]:
    """Score-kernel configs of the default variant at context n; records in DENSE_CFG the best
    summed over batches."""
    rows, total = [], {}
    routing, score_keys, score_dtype = DENSE_VARIANTS["_g16"]
    params = CSAttentionParams(routing=routing)
    for batch in batches:
        q = torch.randn(batch, HQ, D, device=dev, dtype=torch.bfloat16)
        nt = torch.full((batch,), n, dtype=torch.int32, device=dev)
        lo, hi = region(nt, budget.sinks, budget.recent)
        kk = torch.full((batch,), budget.top_k(n), dtype=torch.int32, device=dev)
        tables = random_dense_tables(batch, n, params, dev, score_dtype)
        sel = GpuSelector(params, batch, HQ, HKV, D, n, int(kk[0]), dev, score_keys=score_keys)
        for block, warps, maxnreg in SCORE_SWEEP:
            cfg = {"block": block, "r_chunk": 8, "num_warps": warps, "maxnreg": maxnreg}
            sel.dense_cfg = cfg
            g = capture(lambda: sel.route_dense(q, tables, lo, hi, kk))
            t = time_us(g.replay)
            total[tuple(cfg.items())] = total.get(tuple(cfg.items()), 0.0) + t
            rows.append({"context": n, "batch": batch, "method": f"cs_dense_score_g16_b{block}_w{warps}_r{maxnreg}",
                         "time_us": t, **cfg})
        del tables, sel
        torch.cuda.empty_cache()
    DENSE_CFG.update(dict(min(total, key=total.get)))
    return rows


def tune_topk16(n: int, batches: list[int], budget: Budget, dev: str) -> list[dict]:
    """Keys per program of the radix Top-K over 16-bit keys after pass 0 (pass 1 + collect; pass
    0 restored before each replay) at context n; records in TOPK16_BLOCK the best over batches.
    Also the score kernel of the default variant without its fused pass-0 histogram."""
    from ctxcache.kernels.topk import _BINS, blocks16, workspace
    rows, total = [], {}
    for batch in batches:
        keys = torch.randint(0, 1 << 16, (batch, HKV, n), dtype=torch.int32, device=dev)
        nt = torch.full((batch,), n, dtype=torch.int32, device=dev)
        lo, hi = region(nt, budget.sinks, budget.recent)
        kk = torch.full((batch,), budget.top_k(n), dtype=torch.int32, device=dev)
        out = torch.zeros(batch, HKV, int(kk[0]), dtype=torch.int32, device=dev)
        hist0 = torch.stack([torch.bincount(r >> 8, minlength=_BINS) for r in
                             keys.view(batch * HKV, n)[:, int(lo[0]):int(hi[0])]]).int()
        keys16 = keys.to(torch.int16).view(torch.uint16)
        for block, warps in [(b, w) for b in (1024, 2048, 4096) for w in (2, 4, 8)]:
            ws = workspace(batch * HKV, dev, blocks16(n, block))

            def fn():
                ws.zero_()
                ws[:, :_BINS].copy_(hist0)
                radix_topk(keys16, lo, hi, kk, out, ws, block=block, hist0_done=True, num_warps=warps)
            g = capture(fn)
            t = time_us(g.replay)
            total[(block, warps)] = total.get((block, warps), 0.0) + t
            rows.append({"context": n, "batch": batch, "method": f"topk16_after_pass0_b{block}_w{warps}",
                         "time_us": t, "block": block, "num_warps": warps,
                         "note": "includes the workspace zero + pass-0 restore copy"})
        routing, score_keys, score_dtype = DENSE_VARIANTS["_g16"]
        params = CSAttentionParams(routing=routing)
        tables = random_dense_tables(batch, n, params, dev, score_dtype)
        sel = GpuSelector(params, batch, HQ, HKV, D, n, int(kk[0]), dev, score_keys=score_keys)
        sel.dense_cfg = dict(DENSE_CFG)
        q = torch.randn(batch, HQ, D, device=dev, dtype=torch.bfloat16)
        for hist0_on in (True, False):
            g = capture(lambda: sel.route_dense(q, tables, lo, hi, kk, hist0=hist0_on))
            rows.append({"context": n, "batch": batch, "method": f"cs_dense_score_g16_hist0_{hist0_on}",
                         "time_us": time_us(g.replay), "note": "route (zeroing the workspace) + score kernel"})
        del tables, sel
        torch.cuda.empty_cache()
    TOPK16_BLOCK["block"], TOPK16_BLOCK["num_warps"] = min(total, key=total.get)
    return rows


def tune_attention(n: int, batches: list[int], budget: Budget, dev: str) -> list[dict]:
    """Split count (waves over the SMs, keys per split) and key block of the sparse attention
    over a 5% selection at context n; records in ATTN_PICK the best summed over batches."""
    rows, total = [], {}
    for batch in batches:
        q = torch.randn(batch, HQ, D, device=dev, dtype=torch.bfloat16)
        k = torch.randn(batch, HKV, n, D, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        nt = torch.full((batch,), n, dtype=torch.int32, device=dev)
        k_sel = budget.top_k(n)
        kk = torch.full((batch,), k_sel, dtype=torch.int32, device=dev)
        idx = torch.stack([torch.randperm(n - 64, device=dev)[:k_sel] + 4 for _ in range(batch * HKV)])
        idx = idx.view(batch, HKV, k_sel).int()
        for waves in (2, 4, 8):
            for min_keys in (64, 128):
                for block_n in (32, 64, 128):
                    cfg = {"waves": waves, "min_keys": min_keys, "block_n": block_n}
                    ss = choose_splits(batch * HKV, k_sel + budget.sinks + budget.recent, min_keys=min_keys, waves=waves)
                    g = capture(lambda: sparse_decode_attention(q, k, v, nt, idx, kk, budget.sinks, budget.recent,
                                                                splits=ss, block_n=block_n))
                    t = time_us(g.replay)
                    total[tuple(cfg.items())] = total.get(tuple(cfg.items()), 0.0) + t
                    rows.append({"context": n, "batch": batch, "method": f"sparse_attn_w{waves}_k{min_keys}_b{block_n}",
                                 "time_us": t, "splits": ss, **cfg})
        del k, v
        torch.cuda.empty_cache()
    ATTN_PICK.update(dict(min(total, key=total.get)))
    return rows
