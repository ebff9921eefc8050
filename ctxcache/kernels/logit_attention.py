"""The sparse decode attention with the chosen keys' logits taken from the exact re-rank: V alone
is read for them (issue 46 stage 2b).

Why: the re-rank (rerank.Reranker) computes q.k of every candidate for the group's query heads,
and the chosen keys are some of its candidates; split_k_attention then read their K again and
recomputed the same dots. At 32K x 8 (Llama-3.1-8B shapes, K = 1,639 of 6,556 candidates) that
was 27 MB of the attention's 54 MB. Here each chosen key costs its V row (256 B at D = 128, bf16)
and its G logits (16 B, one sector at G = 4: the Reranker keeps them slot-major with
keep_logits), found by the candidate slot the re-rank's collect writes beside each position.
The sinks and the recent window are not candidates: their q.k still come from K, as before.

Same virtual key list, splits, online softmax and merge as split_k_attention._split_kernel;
each program runs its static keys (one loop) and then its chosen keys (another), so a split
holding both takes at most one block more. Arithmetic: the chosen keys' logits are the
re-rank's fp32 q.k * head_dim ** -0.5 times log2(e) (two roundings where the split kernel
multiplies once by their product, ~1 ulp), and their dots were summed by the re-rank's MMA
(GP = 16 query rows x 128 keys) instead of the attention's (G_PAD rows x BLOCK_N keys):
the same products in a possibly different order; everything after the logits is unchanged."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ctxcache.kernels.split_k_attention import (INTERPRET, empty_partial, group_queries, merge_partials,
                                               online_softmax_step, padded_group, partial_workspace,
                                               softmax_accumulate, split_range, store_partial)
from ctxcache.kernels.sync import launch_opts, pdl_enter

LOG2E = 1.4426950408889634


def logit_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, idx: torch.Tensor,
                        slots: torch.Tensor, logits: torch.Tensor, k_sel: torch.Tensor, n: torch.Tensor,
                        sinks: int, recent: int) -> torch.Tensor:
    """Per row: softmax over the sinks and recent window (q.k * head_dim ** -0.5 from K) and the
    first k_sel[b] chosen keys (their logits logits[b * Hkv + h, slots[b, h, j], g], as given), of
    V. q [B, Hq, D], k/v_cache [B, Hkv, S, D], idx / slots [B, Hkv, K] (positions / candidate
    slots), logits [B * Hkv, KC, G] -> [B, Hq, D] in q's dtype."""
    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    g = hq // hkv
    out = torch.empty_like(q)
    for r in range(b):
        nb, kb = int(n[r]), int(k_sel[r])
        lo = min(sinks, nb)
        hi = max(lo, nb - recent)
        static = torch.cat([torch.arange(lo), torch.arange(hi, nb)]).to(q.device)
        for h in range(hkv):
            qh = q[r, h * g:(h + 1) * g]  # [G, D]
            s_static = qh @ k_cache[r, h, static].to(q.dtype).T * d ** -0.5
            s_chosen = logits[r * hkv + h, slots[r, h, :kb].long()].T.to(q.dtype)  # [G, kb]
            pos = torch.cat([static, idx[r, h, :kb].long().to(q.device)])
            p = torch.cat([s_static, s_chosen], dim=1).softmax(-1)
            out[r, h * g:(h + 1) * g] = p @ v_cache[r, h, pos].to(q.dtype)
    return out


@triton.jit
def _logit_split_kernel(q_ptr, k_ptr, v_ptr, idx_ptr, slot_ptr, logit_ptr, ksel_ptr, n_ptr, o_ws, ml_ws,
                        HKV, SINKS, RECENT, KC, scale_log2, logit_log2,
                        sq_b, sq_h, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, si_b, si_h, ss_b, ss_h,
                        G: tl.constexpr, SPLITS: tl.constexpr, IEEE: tl.constexpr, G_PAD: tl.constexpr,
                        D: tl.constexpr, BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr, PRE_WAIT: tl.constexpr):
    if not PRE_WAIT:
        pdl_enter(USE_PDL)
    row = tl.program_id(0)
    split = tl.program_id(1)
    b = row // HKV
    hkv = row % HKV
    n = tl.load(n_ptr + b)
    k_sel = tl.load(ksel_ptr + b)
    b64 = b.to(tl.int64)  # caches of 8 x 128K tokens are near 2^31 elements
    lo, hi, n_static, start, end = split_range(n, k_sel, split, SINKS, RECENT, SPLITS, BLOCK_N, False)
    offs_d = tl.arange(0, D)
    offs_g = tl.arange(0, G_PAD)
    q = group_queries(q_ptr, b, hkv, G, sq_b, sq_h, G_PAD, D)
    if PRE_WAIT:  # n, k and q come from before the step's first launch (sync.py); the rest waits
        pdl_enter(USE_PDL)
    m_i, l_i, acc = empty_partial(G_PAD, D)
    k_row = k_ptr + b64 * sk_b + hkv * sk_h
    v_row = v_ptr + b64 * sv_b + hkv * sv_h
    static_end = tl.minimum(end, n_static)
    for t0 in range(start, static_end, BLOCK_N):  # sinks [0, lo) and recent window [hi, n): q.k from K
        t = t0 + tl.arange(0, BLOCK_N)
        valid = t < static_end
        pos = tl.where(valid, tl.where(t < lo, t, hi + t - lo), 0)
        kb = tl.load(k_row + pos[:, None].to(tl.int64) * sk_s + offs_d[None, :])
        vb = tl.load(v_row + pos[:, None].to(tl.int64) * sv_s + offs_d[None, :])
        m_i, l_i, acc = online_softmax_step(q, kb, vb, valid, m_i, l_i, acc, scale_log2, IEEE)
    for t0 in range(tl.maximum(start, n_static), end, BLOCK_N):  # the chosen keys: the re-rank's logits, V
        t = t0 + tl.arange(0, BLOCK_N)
        valid = t < end
        j = t - n_static
        pos = tl.load(idx_ptr + b * si_b + hkv * si_h + j, mask=valid, other=0)
        slot = tl.load(slot_ptr + b * ss_b + hkv * ss_h + j, mask=valid, other=0)
        lg = tl.load(logit_ptr + (row.to(tl.int64) * KC + slot[None, :]) * G + offs_g[:, None],
                     mask=(offs_g < G)[:, None] & valid[None, :], other=0.0)
        vb = tl.load(v_row + pos[:, None].to(tl.int64) * sv_s + offs_d[None, :])
        m_i, l_i, acc = softmax_accumulate(lg * logit_log2, vb, valid, m_i, l_i, acc, IEEE)
    store_partial(o_ws, ml_ws, row * SPLITS + split, m_i, l_i, acc, G, G_PAD, D)


def logit_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, n: torch.Tensor,
                           idx: torch.Tensor, slots: torch.Tensor, logits: torch.Tensor, k_sel: torch.Tensor,
                           sinks: int = 0, recent: int = 0, splits: int = 16, out: torch.Tensor | None = None,
                           ws: tuple[torch.Tensor, torch.Tensor] | None = None, block_n: int = 64, pdl: bool = False,
                           num_warps: int = 4, num_stages: int | None = None, pre_wait: bool = True) -> torch.Tensor:
    """sparse_decode_attention's sparse case, the chosen keys' logits gathered from the re-rank:
    idx [B, Hkv, K_max] their positions and slots [B, Hkv, K_max] their candidate slots (int32, row
    b's first k_sel[b]; Reranker's return and chosen()), logits [B * Hkv, KC, G] fp32 the re-rank's
    q.k * head_dim ** -0.5 of every candidate slot. Other arguments as sparse_decode_attention."""
    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    if k_cache.shape[0] != b or v_cache.shape != k_cache.shape or k_cache.shape[3] != d or hq % hkv:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k_cache.shape)}, v {tuple(v_cache.shape)} disagree")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1 or d & (d - 1) or d < 16:
        raise ValueError(f"need contiguous head dims and a power-of-two head_dim >= 16, got {d}")
    for name, t in (("n", n), ("k_sel", k_sel)):
        if t.shape != (b,) or t.dtype != torch.int32:
            raise ValueError(f"{name} {tuple(t.shape)} {t.dtype} must be int32 [{b}]")
    for name, t in (("idx", idx), ("slots", slots)):
        if t.shape[:2] != (b, hkv) or t.dtype != torch.int32 or t.stride(2) != 1:
            raise ValueError(f"{name} {tuple(t.shape)} {t.dtype} must be int32 [{b}, {hkv}, K] contiguous in K")
    g = hq // hkv
    if (logits.dim() != 3 or logits.shape[0] != b * hkv or logits.shape[2] != g or logits.dtype != torch.float32
            or not logits.is_contiguous()):
        raise ValueError(f"logits {tuple(logits.shape)} {logits.dtype} must be contiguous fp32 [{b * hkv}, KC, {g}] "
                         "(Reranker keep_logits)")
    if splits & (splits - 1):
        raise ValueError(f"splits={splits} must be a power of two")
    ws = partial_workspace(b, hq, hkv, splits, d, q.device) if ws is None else ws
    out = torch.empty_like(q) if out is None else out
    _logit_split_kernel[(b * hkv, splits)](
        q, k_cache, v_cache, idx, slots, logits, k_sel, n, ws[0], ws[1],
        hkv, sinks, recent, logits.shape[1], d ** -0.5 * LOG2E, LOG2E,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], idx.stride(0), idx.stride(1),
        slots.stride(0), slots.stride(1),
        G=g, SPLITS=splits, IEEE=q.dtype == torch.float32 or INTERPRET, G_PAD=padded_group(g), D=d,
        BLOCK_N=block_n, USE_PDL=pdl, PRE_WAIT=pre_wait, num_warps=num_warps, **launch_opts(pdl),
        **({"num_stages": num_stages} if num_stages else {}))
    return merge_partials(ws, out, hkv, splits, pdl, trigger=pre_wait)


def chosen_bytes(batch: int, hkv: int, k: int, g: int, d: int, elem: int = 2) -> dict[str, int]:
    """The chosen keys' bytes per layer, each path (bench rows): V + K rows (split_k_attention)
    against V rows + G fp32 logits + a slot (here); positions are read by both."""
    rows = batch * hkv * k
    return {"k_and_v": rows * 2 * d * elem, "v_and_logits": rows * (d * elem + 4 * g + 4),
            "ratio": round(rows * (d * elem + 4 * g + 4) / (rows * 2 * d * elem), 3)}
