"""The Top-K collect fused into the split-K sparse attention: one launch after radix pass 1.

The default step ends: score kernel (16-bit keys + radix pass 0) -> radix pass 1 -> collect
(every row's selected indices into idx, slots by atomics) -> split-K attention over idx ->
merge. Here the collect and the split-K attention are one launch. Each program owns one radix
block of one (row, KV head), the block whose pass-1 tie counts pass 1 already stored:
1. it walks the row's two finished histograms to the exact threshold (as topk's collect does)
   and marks its block's selected keys: every key above the threshold, and keys equal to it
   while the ties of the earlier blocks plus its own rank stay below the number still needed
   (ties to the lowest index, the reference's order);
2. it compacts their positions into its own slice of a list buffer (plus a count), and the
   program of block 0 also takes the static keys (sinks and the recent window);
3. it attends the group's queries over them and writes a partial that the merge combines.

So the selection never goes through a row-wide list: no atomics for slots, no launch between
selecting and reading K/V, and the block's keys are read once. The list slices hold the
selection for checks (`selected_indices`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ctxcache.kernels.sparse_attention import (INTERPRET, _merge_kernel, attend_chunk, group_pad, group_query,
                                               sparse_attention_ref, store_partial)
from ctxcache.kernels.sync import launch_opts, pdl_enter
from ctxcache.kernels.topk import _HEAD, _block_keys, _walk, blocks16, topk16_ref


def select_attention_ref(q, k_cache, v_cache, n, keys, lo, hi, k, sinks: int, recent: int) -> torch.Tensor:
    """Torch reference: topk16_ref's selection of keys [B, Hkv, N] (int32 codes) per row, then
    sparse_attention_ref over sinks + selection + recent. q [B, Hq, D] -> [B, Hq, D]."""
    b, hkv, n_max = keys.shape
    rows = keys.reshape(b * hkv, n_max)
    sel = topk16_ref(rows, lo.repeat_interleave(hkv), hi.repeat_interleave(hkv), k.repeat_interleave(hkv))
    k_max = max(1, int(k.max()))
    idx = torch.zeros(b * hkv, k_max, dtype=torch.int32)
    for r, s in enumerate(sel):
        idx[r, :s.numel()] = s.cpu().int()
    return sparse_attention_ref(q, k_cache, v_cache, idx.view(b, hkv, k_max), k.cpu(), n.cpu(), sinks, recent)


@triton.jit
def _block_selection(keys_ptr, lo_ptr, hi_ptr, k_ptr, ws_ptr, HKV, sx_r, sws_r, HEAD,
                     BLOCK: tl.constexpr, NB_PAD: tl.constexpr):
    """This program's block: (positions, selected mask). Exact: the same keys as topk's collect."""
    key, valid, offs, k, hist_ptr = _block_keys(keys_ptr, lo_ptr, hi_ptr, k_ptr, ws_ptr, HKV, sx_r, sws_r,
                                                BLOCK, True)
    thresh, need = _walk(hist_ptr, k, 2, 8)
    take = valid & (key > thresh)
    eq = valid & (key == thresh)
    if tl.sum(eq.to(tl.int32), axis=0) > 0:  # most blocks hold no key equal to the threshold
        bs = tl.arange(0, NB_PAD)  # ties in the blocks before this one, from their pass-1 histograms
        eq_before = tl.sum(tl.load(hist_ptr + HEAD + bs * 256 + (thresh & 255).to(tl.int32),
                                   mask=bs < tl.program_id(1), other=0), axis=0)
        take = take | (eq & (eq_before + tl.cumsum(eq.to(tl.int32), axis=0) - 1 < need))
    return offs, take


@triton.jit
def _select_attend_kernel(q_ptr, k_ptr, v_ptr, keys_ptr, lo_ptr, hi_ptr, ksel_ptr, n_ptr, ws_ptr, list_ptr, cnt_ptr,
                          o_ws, ml_ws, HKV, G, SINKS, RECENT, HEAD, scale_log2,
                          sq_b, sq_h, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sx_r, sws_r,
                          BLOCK: tl.constexpr, NB_PAD: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                          BLOCK_N: tl.constexpr, IEEE: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    row = tl.program_id(0)
    blk = tl.program_id(1)
    offs, take = _block_selection(keys_ptr, lo_ptr, hi_ptr, ksel_ptr, ws_ptr, HKV, sx_r, sws_r, HEAD, BLOCK, NB_PAD)
    n_take = tl.sum(take.to(tl.int32), axis=0)
    lst = list_ptr + (row * NB_PAD + blk).to(tl.int64) * BLOCK
    tl.store(lst + tl.cumsum(take.to(tl.int32), axis=0) - 1, offs, mask=take)
    tl.store(cnt_ptr + row * NB_PAD + blk, n_take)
    tl.debug_barrier()  # every thread's compacted positions are visible to all threads below
    b = row // HKV
    hkv = row % HKV
    b64 = b.to(tl.int64)  # caches of 8 x 128K tokens are near 2^31 elements
    k_row = k_ptr + b64 * sk_b + hkv * sk_h
    v_row = v_ptr + b64 * sv_b + hkv * sv_h
    q, m_i, l_i, acc = group_query(q_ptr + b * sq_b + hkv * G * sq_h, G, sq_h, G_PAD, D)
    if blk == 0:  # the static keys: sinks [0, s_lo) and the recent window [s_hi, n)
        n = tl.load(n_ptr + b)
        s_lo = tl.minimum(n, SINKS)
        s_hi = tl.maximum(s_lo, n - RECENT)
        n_static = s_lo + n - s_hi
        for t0 in range(0, n_static, BLOCK_N):
            t = t0 + tl.arange(0, BLOCK_N)
            m_i, l_i, acc = attend_chunk(q, k_row, v_row, sk_s, sv_s, tl.where(t < s_lo, t, s_hi + t - s_lo),
                                         t < n_static, m_i, l_i, acc, scale_log2, D, IEEE)
    for c0 in range(0, n_take, BLOCK_N):
        c = c0 + tl.arange(0, BLOCK_N)
        pos = tl.load(lst + c, mask=c < n_take, other=0)
        m_i, l_i, acc = attend_chunk(q, k_row, v_row, sk_s, sv_s, pos, c < n_take, m_i, l_i, acc, scale_log2, D,
                                     IEEE)
    store_partial(o_ws, ml_ws, (row * NB_PAD + blk) * G_PAD, tl.arange(0, G_PAD), G, acc, m_i, l_i, D)


def select_buffers(batch: int, n_heads: int, n_kv: int, n_max: int, block: int, head_dim: int,
                   device: torch.device | str) -> tuple[torch.Tensor, ...]:
    """(position lists [B, Hkv, NB_PAD, block] int32, counts [B, Hkv, NB_PAD] int32, partial
    outputs, partial (max, sum)) for select_attention; reusable across steps (graph-static)."""
    nb_pad = triton.next_power_of_2(blocks16(n_max, block))
    rows, g_pad = batch * n_kv * nb_pad, group_pad(n_heads // n_kv)
    return (torch.zeros(batch, n_kv, nb_pad, block, dtype=torch.int32, device=device),
            torch.zeros(batch, n_kv, nb_pad, dtype=torch.int32, device=device),
            torch.empty(rows * g_pad * head_dim, dtype=torch.float32, device=device),
            torch.empty(rows * g_pad * 2, dtype=torch.float32, device=device))


def selected_indices(lists: torch.Tensor, counts: torch.Tensor, k_max: int) -> torch.Tensor:
    """The selection a select_attention call made, as idx [B, Hkv, k_max] (ascending, each row's
    first sum(counts) entries; the rest 0), for checks against the reference."""
    b, hkv, nb, block = lists.shape
    slot = torch.arange(block, device=lists.device)
    keep = slot < counts[..., None]
    idx = torch.zeros(b, hkv, k_max, dtype=torch.int32, device=lists.device)
    for r in range(b):
        for h in range(hkv):
            got = lists[r, h][keep[r, h]]
            idx[r, h, :got.numel()] = got
    return idx


def select_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, n: torch.Tensor,
                     keys: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, k: torch.Tensor, ws: torch.Tensor,
                     block: int, sinks: int, recent: int, bufs: tuple[torch.Tensor, ...] | None = None,
                     out: torch.Tensor | None = None, block_n: int = 128, pdl: bool = False,
                     num_warps: int = 4, num_stages: int | None = None) -> torch.Tensor:
    """Attention over sinks + the Top-K of keys + recent, for keys [B, Hkv, N] uint16 whose
    radix passes 0 and 1 are in ws (topk.radix_pass1_16 with the same `block`); lo, hi, k [B]
    int32 the selection's region and size (Budget.region / top_k), n [B] int32 cached keys;
    q [B, Hq, D], k/v_cache [B, Hkv, S, D] -> [B, Hq, D]. bufs: select_buffers(...) (made here
    if None; pass static ones inside a captured graph)."""
    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    if k_cache.shape[0] != b or v_cache.shape != k_cache.shape or k_cache.shape[3] != d or hq % hkv:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k_cache.shape)}, v {tuple(v_cache.shape)} disagree")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1 or d & (d - 1) or d < 16:
        raise ValueError(f"need contiguous head dims and a power-of-two head_dim >= 16, got {d}")
    if keys.dtype != torch.uint16 or keys.shape[:2] != (b, hkv) or keys.stride(2) != 1 \
            or keys.stride(0) != hkv * keys.stride(1):
        raise ValueError(f"keys {tuple(keys.shape)} {keys.dtype} must be uint16 [{b}, {hkv}, N], rows mergeable")
    for name, t in (("n", n), ("lo", lo), ("hi", hi), ("k", k)):
        if t.shape != (b,) or t.dtype != torch.int32:
            raise ValueError(f"{name} {tuple(t.shape)} {t.dtype} must be int32 [{b}]")
    nb = blocks16(keys.shape[2], block)
    if ws.shape[0] != b * hkv or ws.shape[1] < _HEAD + nb * 256 or ws.stride(1) != 1:
        raise ValueError(f"ws {tuple(ws.shape)} needs {b * hkv} rows of {_HEAD + nb * 256} columns")
    g = hq // hkv
    g_pad = group_pad(g)
    bufs = select_buffers(b, hq, hkv, keys.shape[2], block, d, q.device) if bufs is None else bufs
    lists, counts, o_ws, ml_ws = bufs
    nb_pad = lists.shape[2]
    if lists.shape != (b, hkv, triton.next_power_of_2(nb), block) or counts.shape != (b, hkv, nb_pad) \
            or o_ws.numel() < b * hkv * nb_pad * g_pad * d:
        raise ValueError("bufs do not match these shapes and this block (use select_buffers)")
    out = torch.empty_like(q) if out is None else out
    _select_attend_kernel[(b * hkv, nb_pad)](
        q, k_cache, v_cache, keys, lo, hi, k, n, ws, lists, counts, o_ws, ml_ws,
        hkv, g, sinks, recent, _HEAD, d ** -0.5 * 1.4426950408889634,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], keys.stride(1), ws.stride(0),
        BLOCK=block, NB_PAD=nb_pad, G_PAD=g_pad, D=d, BLOCK_N=block_n, IEEE=q.dtype == torch.float32 or INTERPRET,
        USE_PDL=pdl, num_warps=num_warps, **launch_opts(pdl), **({"num_stages": num_stages} if num_stages else {}))
    _merge_kernel[(b * hkv * g,)](o_ws, ml_ws, out, hkv, g, out.stride(0), out.stride(1),
                                  SPLITS=nb_pad, G_PAD=g_pad, D=d, USE_PDL=pdl, **launch_opts(pdl))
    return out
