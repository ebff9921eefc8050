"""Dense-layout CSAttention scores as 16-bit Top-K keys, with the route fused in and the
block statistics select16 needs (routing="group", the default).

One program per (row = (batch, KV head), block of BLOCK keys):
1. route (FUSE_ROUTE): sum the GQA group's query heads, pick each subspace's nearest
   centroid (argmax of q_j . c, as route.route with group=True) and its weight ||q_j|| (or 1
   for weighting="unit"); otherwise ids / w come from a separate route launch;
2. score: the weighted sum of the m routed dense_score rows (+ streamed keys), as
   dense_select.dense_scores, written as order-preserving 16-bit keys of the fp16-rounded
   score (topk.keys16_ref);
3. statistics over [lo, hi): the keys' top-byte histogram added to the row's hist0 (atomics)
   and the block's suffix counts ge[d] = keys with top byte >= d (a plain store), which let
   select16 place every selected key without atomics.
Fusing the route saves a launch and the ids round trip; every program re-reads the row's
centroids (m x C x d_b fp16, 32 KB at Llama-3.1-8B shapes) from L2, so it pays off for large
blocks (bench attention sweeps both).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ctxcache.kernels.dense_select import dense_scores_ref
from ctxcache.kernels.route import route_ref
from ctxcache.kernels.select16 import _BINS, _HEAD, BINS, HEAD
from ctxcache.kernels.sync import launch_opts, pdl_enter
from ctxcache.kernels.topk import _keys16, keys16_ref


def dense_keys_ref(q: torch.Tensor, centroids: torch.Tensor, dense: torch.Tensor, scale: torch.Tensor | None,
                   new_scores: torch.Tensor, n_ctx: torch.Tensor, start: torch.Tensor, count: torch.Tensor,
                   n_pad: int, unit_weights: bool = False) -> torch.Tensor:
    """Torch reference: group route + dense scores -> int32 key codes [B, Hkv, n_pad]."""
    ids, w = route_ref(q, centroids, group=True)
    if unit_weights:
        w = torch.ones_like(w)
    return keys16_ref(dense_scores_ref(ids, w, dense, scale, new_scores, n_ctx, start, count, n_pad))


def block_counts_ref(keys: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, k: torch.Tensor,
                     block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hist0 [R, 256], ge [R, n_pad // block, 256]) of int32 key codes [B, Hkv, n_pad]."""
    b, hkv, n_pad = keys.shape
    pos = torch.arange(n_pad, device=keys.device)
    valid = (pos >= lo[:, None]) & (pos < hi[:, None]) & (k[:, None] > 0)  # [B, n_pad]
    digit = (keys >> 8).long().view(b * hkv, n_pad // block, block)
    mask = valid.repeat_interleave(hkv, 0).view(b * hkv, n_pad // block, block)
    onehot = torch.zeros(b * hkv, n_pad // block, BINS, dtype=torch.int32, device=keys.device)
    onehot.scatter_add_(2, digit, mask.int())
    ge = onehot.flip(-1).cumsum(-1).flip(-1).int()
    return onehot.sum(1).int(), ge


@triton.jit
def _route_group(q_ptr, c_ptr, b, h, G, M, C, DB, sq_b, sq_h, sc_b, sc_h, sc_m, sc_c,
                 M_PAD: tl.constexpr, C_PAD: tl.constexpr, DB_PAD: tl.constexpr):
    """(ids [M_PAD] int32, ||q_j|| [M_PAD]) of the group-summed query of KV head h."""
    jm = tl.arange(0, M_PAD)
    cc = tl.arange(0, C_PAD)
    dd = tl.arange(0, DB_PAD)
    qmask = (jm < M)[:, None] & (dd < DB)[None, :]
    qs = tl.zeros((M_PAD, DB_PAD), tl.float32)
    for g in range(G):
        qs += tl.load(q_ptr + b * sq_b + (h * G + g) * sq_h + jm[:, None] * DB + dd[None, :], mask=qmask,
                      other=0.0).to(tl.float32)
    cptr = (c_ptr + b * sc_b + h * sc_h + jm[:, None, None] * sc_m + cc[None, :, None] * sc_c
            + dd[None, None, :])
    cmask = qmask[:, None, :] & (cc < C)[None, :, None]
    cent = tl.load(cptr, mask=cmask, other=0.0).to(tl.float32)  # [M_PAD, C_PAD, DB_PAD]
    dots = tl.sum(cent * qs[:, None, :], axis=2)
    dots = tl.where((cc < C)[None, :], dots, float("-inf"))
    return tl.argmax(dots, axis=1).to(tl.int32), tl.sqrt(tl.sum(qs * qs, axis=1))


@triton.jit
def _dense_keys_kernel(q_ptr, c_ptr, ids_ptr, w_ptr, ds_ptr, scale_ptr, ns_ptr, nctx_ptr, start_ptr, cnt_ptr,
                       lo_ptr, hi_ptr, k_ptr, keys_ptr, ws_ptr, HKV, G, M, C, DB,
                       sq_b, sq_h, sc_b, sc_h, sc_m, sc_c, si_b, si_h, sd_b, sd_h, sd_m, sd_c,
                       ss_b, ss_h, ss_m, sn_b, sn_h, sn_m, sn_c, sk_r, sws_r,
                       M_PAD: tl.constexpr, C_PAD: tl.constexpr, DB_PAD: tl.constexpr, BLOCK: tl.constexpr,
                       FUSE_ROUTE: tl.constexpr, UNIT_W: tl.constexpr, SCALED: tl.constexpr,
                       USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    row = tl.program_id(0)
    blk = tl.program_id(1)
    b = row // HKV
    h = row % HKV
    jm = tl.arange(0, M_PAD)
    okm = jm < M
    if FUSE_ROUTE:
        c, w = _route_group(q_ptr, c_ptr, b, h, G, M, C, DB, sq_b, sq_h, sc_b, sc_h, sc_m, sc_c,
                            M_PAD, C_PAD, DB_PAD)
    else:
        c = tl.load(ids_ptr + b * si_b + h * si_h + jm, mask=okm, other=0)
        w = tl.load(w_ptr + b * si_b + h * si_h + jm, mask=okm, other=0.0)
    if UNIT_W:
        w = tl.where(okm, 1.0, 0.0)
    wq = w
    if SCALED:
        wq = w * tl.load(scale_ptr + b * ss_b + h * ss_h + jm * ss_m + c, mask=okm, other=0.0)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    nctx = tl.load(nctx_ptr + b)
    # int64: a batch of 128K-token tables exceeds 2^31 elements
    base = b.to(tl.int64) * sd_b + h.to(tl.int64) * sd_h + jm * sd_m + c.to(tl.int64) * sd_c
    x = tl.load(ds_ptr + base[:, None] + offs[None, :], mask=okm[:, None] & (offs < nctx)[None, :], other=0)
    acc = tl.sum(x.to(tl.float32) * wq[:, None], axis=0)
    s0 = tl.load(start_ptr + b)
    cnt = tl.load(cnt_ptr + b)
    if (cnt > 0) & (s0 < blk * BLOCK + BLOCK) & (s0 + cnt > blk * BLOCK):  # block holds streamed keys
        t = offs - s0
        nbase = b * sn_b + h * sn_h + jm * sn_m + c * sn_c
        y = tl.load(ns_ptr + nbase[:, None] + t[None, :], mask=okm[:, None] & ((t >= 0) & (t < cnt))[None, :],
                    other=0.0)
        acc += tl.sum(y * w[:, None], axis=0)
    key = _keys16(acc)
    tl.store(keys_ptr + row * sk_r + offs, key)
    lo = tl.load(lo_ptr + b)
    hi = tl.load(hi_ptr + b)
    k = tl.load(k_ptr + b)
    hist = tl.histogram((key >> 8).to(tl.int32), _BINS, mask=(offs >= lo) & (offs < hi) & (k > 0))
    bins = tl.arange(0, _BINS)
    ws = ws_ptr + row * sws_r
    tl.atomic_add(ws + bins, hist, mask=hist > 0, sem="relaxed")  # a block fills few of the bins
    tl.store(ws + _HEAD + blk * _BINS + bins, tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist)


def dense_keys(q: torch.Tensor | None, centroids: torch.Tensor, dense: torch.Tensor, scale: torch.Tensor | None,
               new_scores: torch.Tensor, n_ctx: torch.Tensor, start: torch.Tensor, count: torch.Tensor,
               lo: torch.Tensor, hi: torch.Tensor, k: torch.Tensor, keys: torch.Tensor, ws: torch.Tensor,
               block: int = 2048, routed: tuple[torch.Tensor, torch.Tensor] | None = None,
               unit_weights: bool = False, num_warps: int = 8, pdl: bool = False) -> torch.Tensor:
    """q [B, Hq, D] (subspaces contiguous); centroids [B, Hkv, m, C, d_b]; dense [B, Hkv, m, C, N]
    fp16 (or int8 with scale [B, Hkv, m, C]); new_scores [B, Hkv, m, C, T] fp32; n_ctx, start,
    count, lo, hi, k [B] int32 -> keys [B, Hkv, N_pad] uint16; adds hist0 and stores the block
    counts into ws (select16.workspace16 with this block). routed=(ids, w) [B, Hkv, m] skips the
    fused route (q unused)."""
    bd, hkv, m, c, n = dense.shape
    b = keys.shape[0]
    db = centroids.shape[-1]
    if bd != b or centroids.shape[:4] != (b, hkv, m, c) or centroids.stride(4) != 1 or dense.stride(4) != 1:
        raise ValueError(f"centroids {tuple(centroids.shape)}, dense {tuple(dense.shape)} and keys "
                         f"{tuple(keys.shape)} disagree (need contiguous last dims)")
    if dense.dtype not in (torch.float16, torch.int8) or (scale is not None) != (dense.dtype == torch.int8):
        raise ValueError(f"dense {dense.dtype} must be fp16, or int8 with its scale")
    if routed is None and (q is None or q.dim() != 3 or q.shape[0] != b or q.shape[1] % hkv
                           or q.shape[2] != m * db or q.stride(2) != 1):
        raise ValueError(f"q {None if q is None else tuple(q.shape)} must be [{b}, G * {hkv}, {m * db}]")
    if routed is not None and any(t.shape != (b, hkv, m) or not t.is_contiguous() for t in routed):
        raise ValueError(f"routed ids / w must be contiguous [{b}, {hkv}, {m}]")
    if new_scores.shape[:4] != (b, hkv, m, c) or new_scores.stride(4) != 1 or new_scores.dtype != torch.float32:
        raise ValueError(f"new_scores {tuple(new_scores.shape)} must be fp32 [{b}, {hkv}, {m}, {c}, T]")
    n_pad = keys.shape[2]
    if keys.dtype != torch.uint16 or keys.shape[1] != hkv or keys.stride(2) != 1 or n_pad % block or n_pad < n:
        raise ValueError(f"keys {tuple(keys.shape)} {keys.dtype} must be uint16 [{b}, {hkv}, N_pad >= {n}], "
                         f"N_pad a multiple of block={block}")
    if ws.shape != (b * hkv, HEAD + (n_pad // block) * BINS) or not ws.is_contiguous():
        raise ValueError(f"ws {tuple(ws.shape)} must be select16.workspace16({b * hkv}, {n_pad}, {block})")
    for name, t in (("n_ctx", n_ctx), ("start", start), ("count", count), ("lo", lo), ("hi", hi), ("k", k)):
        if t.shape != (b,) or t.dtype != torch.int32:
            raise ValueError(f"{name} {tuple(t.shape)} {t.dtype} must be int32 [{b}]")
    ids, w = routed if routed is not None else (lo, lo)  # unused pointers when the route is fused
    qq = q if q is not None else centroids
    sq = (q.stride(0), q.stride(1)) if q is not None else (0, 0)
    sc, sd, sn = centroids.stride(), dense.stride(), new_scores.stride()
    ss = scale.stride()[:3] if scale is not None else (0, 0, 0)
    si = (ids.stride(0), ids.stride(1)) if routed is not None else (0, 0)
    _dense_keys_kernel[(b * hkv, n_pad // block)](
        qq, centroids, ids, w, dense, scale if scale is not None else new_scores, new_scores, n_ctx, start, count,
        lo, hi, k, keys, ws, hkv, (qq.shape[1] // hkv) if q is not None else 1, m, c, db, *sq,
        sc[0], sc[1], sc[2], sc[3], *si, sd[0], sd[1], sd[2], sd[3], *ss, sn[0], sn[1], sn[2], sn[3],
        keys.stride(1), ws.stride(0),
        M_PAD=triton.next_power_of_2(m), C_PAD=triton.next_power_of_2(c), DB_PAD=max(16, triton.next_power_of_2(db)),
        BLOCK=block, FUSE_ROUTE=routed is None, UNIT_W=unit_weights, SCALED=scale is not None, USE_PDL=pdl,
        num_warps=num_warps, **launch_opts(pdl))
    return keys
