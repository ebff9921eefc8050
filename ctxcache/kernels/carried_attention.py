"""Split-K sparse decode attention for CSAttention's reselect: a row carrying its last selection
(kernels/carry.py) attends every one of its re-rank candidates, the others their re-ranked top K.

Row b's keys: sinks + recent window, then cand[b, h, :kc[b]] where carried[b] (-1: padding, weighs
nothing), else idx[b, h, :k[b]]. With `logits` the programs also write every candidate slot's
logit per query head (log2 units, -inf for padding), and their partials (max, sum) are those of
the re-rank's softmax over the same keys: Reranker.rank then scores and ranks the candidates
without reading their keys again (a lean step, where every row carries, reads K once where the
re-rank's logits launch and the attention read it twice)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ctxcache.kernels.split_k_attention import (INTERPRET, block_logits, group_queries, merge_partials,
                                               online_softmax_update, padded_group, split_range, store_partial)
from ctxcache.kernels.sync import launch_opts, pdl_enter
from ctxcache.models.attention import gather_attention

NEG: tl.constexpr = tl.constexpr(-1.0e30)  # a split's running max before any key: a block of padding only stays finite


@triton.jit
def _carried_split_kernel(q_ptr, k_ptr, v_ptr, idx_ptr, ksel_ptr, cand_ptr, kc_ptr, carried_ptr, n_ptr, o_ws, ml_ws,
                          logit_ptr, HKV, G, SINKS, RECENT, KC, scale_log2, sq_b, sq_h, sk_b, sk_h, sk_s,
                          sv_b, sv_h, sv_s, si_b, si_h, sc_b, sc_h, SPLITS: tl.constexpr, IEEE: tl.constexpr,
                          G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, LOGITS: tl.constexpr,
                          USE_PDL: tl.constexpr):
    row = tl.program_id(0)
    split = tl.program_id(1)
    b = row // HKV
    hkv = row % HKV
    n = tl.load(n_ptr + b)
    b64 = b.to(tl.int64)
    carried = tl.load(carried_ptr + b) != 0
    if carried:
        k_sel = tl.load(kc_ptr + b)
        src = cand_ptr + b * sc_b + hkv * sc_h
    else:
        k_sel = tl.load(ksel_ptr + b)
        src = idx_ptr + b * si_b + hkv * si_h
    lo, hi, n_static, start, end = split_range(n, k_sel, split, SINKS, RECENT, SPLITS, BLOCK_N, False)
    offs_d = tl.arange(0, D)
    offs_g = tl.arange(0, G_PAD)
    q = group_queries(q_ptr, b, hkv, G, sq_b, sq_h, G_PAD, D)
    pdl_enter(USE_PDL)  # n, the counts, carried and q come from before the step; the selections need the wait
    m_i = tl.full((G_PAD,), NEG, tl.float32)
    l_i = tl.zeros((G_PAD,), tl.float32)
    acc = tl.zeros((G_PAD, D), tl.float32)
    for t0 in range(start, end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        in_chunk = t < end
        is_sel = in_chunk & (t >= n_static)
        sel = tl.load(src + (t - n_static), mask=is_sel, other=0)
        valid = in_chunk & ((t < n_static) | (sel >= 0))
        pos = tl.where(t < n_static, tl.where(t < lo, t, hi + t - lo), sel)
        pos = tl.where(valid, pos, 0).to(tl.int64)
        kb = tl.load(k_ptr + b64 * sk_b + hkv * sk_h + pos[:, None] * sk_s + offs_d[None, :], mask=valid[:, None],
                     other=0.0)
        vb = tl.load(v_ptr + b64 * sv_b + hkv * sv_h + pos[:, None] * sv_s + offs_d[None, :], mask=valid[:, None],
                     other=0.0)
        s = block_logits(q, kb, valid, scale_log2, IEEE)
        if LOGITS:
            slot = t - n_static
            tl.store(logit_ptr + (row * G + offs_g[:, None]).to(tl.int64) * KC + slot[None, :], s,
                     mask=(offs_g < G)[:, None] & is_sel[None, :])
        m_i, l_i, acc = online_softmax_update(s, vb, m_i, l_i, acc, IEEE)
    store_partial(o_ws, ml_ws, row * SPLITS + split, m_i, l_i, acc, G, G_PAD, D)


def carried_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, n: torch.Tensor,
                      idx: torch.Tensor, k_sel: torch.Tensor, cand: torch.Tensor, kc: torch.Tensor,
                      carried: torch.Tensor, sinks: int, recent: int, splits: int,
                      ws: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor | None = None,
                      logits: torch.Tensor | None = None, block_n: int = 128, pdl: bool = False,
                      num_warps: int = 4, num_stages: int | None = None) -> torch.Tensor:
    """q [B, Hq, D]; k/v_cache [B, Hkv, S, D]; n, k_sel, kc, carried [B] int32; idx [B, Hkv, >= max k_sel]
    and cand [B, Hkv, >= max kc] int32 -> [B, Hq, D]. ws: split_k_attention.partial_workspace's
    (B, Hq, Hkv, splits); its (max, sum) pairs stay there for Reranker.rank. logits [B x Hkv, G,
    KC] fp32: where given, every row's candidate slots' logits (all rows must carry)."""
    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    for name, t in (("idx", idx), ("cand", cand)):
        if t.shape[:2] != (b, hkv) or t.dtype != torch.int32 or t.stride(2) != 1:
            raise ValueError(f"{name} {tuple(t.shape)} {t.dtype} must be int32 [{b}, {hkv}, *]")
    g = hq // hkv
    if logits is not None and (logits.shape[:2] != (b * hkv, g) or logits.dtype != torch.float32
                               or not logits.is_contiguous()):
        raise ValueError(f"logits {tuple(logits.shape)} {logits.dtype} must be contiguous fp32 [{b * hkv}, {g}, KC]")
    out = torch.empty_like(q) if out is None else out
    _carried_split_kernel[(b * hkv, splits)](
        q, k_cache, v_cache, idx, k_sel, cand, kc, carried, n, ws[0], ws[1], logits if logits is not None else q,
        hkv, g, sinks, recent, logits.shape[2] if logits is not None else 0, d ** -0.5 * 1.4426950408889634,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], idx.stride(0), idx.stride(1),
        cand.stride(0), cand.stride(1), SPLITS=splits, IEEE=q.dtype == torch.float32 or INTERPRET,
        G_PAD=padded_group(g), D=d, BLOCK_N=block_n, LOGITS=logits is not None, USE_PDL=pdl, num_warps=num_warps,
        **({} if num_stages is None else {"num_stages": num_stages}), **launch_opts(pdl))
    return merge_partials(ws, out, hkv, splits, pdl)


def carried_attention_ref(q, k_cache, v_cache, idx, k_sel, cand, kc, carried, n, sinks: int,
                          recent: int) -> torch.Tensor:
    """Per row: gather_attention over the sinks, the recent window and its list (cand[:kc] less
    the -1 padding where carried, else idx[:k_sel]). q [B, Hq, D] -> [B, Hq, D]."""
    outs = []
    for b in range(q.shape[0]):
        nb = int(n[b])
        lo, hi = min(sinks, nb), max(min(sinks, nb), nb - recent)
        static = torch.cat([torch.arange(lo), torch.arange(hi, nb)]).to(q.device).expand(k_cache.shape[1], -1)
        picked = cand[b, :, :int(kc[b])] if int(carried[b]) else idx[b, :, :int(k_sel[b])]
        sel = torch.cat([static, picked.long()], dim=1)
        outs.append(gather_attention(q[b], k_cache[b], v_cache[b], sel.clamp(min=0), sel >= 0))
    return torch.stack(outs)
