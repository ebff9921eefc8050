"""Split-K sparse decode attention whose K/V live in pinned host memory, with a GPU slot cache.

The CPU<->GPU mode keeps every layer's K/V in pinned host memory; under UVA that memory is
addressable from kernels, so the attention kernel reads the rows it needs straight over PCIe
(zero-copy) and nothing else moves. A GPU-resident cache of recently selected rows saves
those reads: slot[b, h, j] >= 0 says selected key j sits in cache slot slot[b, h, j];
slot < 0 says it is a miss, read from the host and written into cache slot -slot - 1 (slots
written this step are never read this step, decoder/gpu/offload.plan_slots guarantees it,
so the kernel has no read/write race). Sinks and the recent window (36 rows) are read from
the host. Same virtual key list, split and merge as sparse_attention._split_kernel.

K in HBM (k_cache None: the offload runner's stage 2): every key's K is read from k_host, here
an HBM buffer of the context's exact K, and the slot cache holds V alone, so only the misses'
V rows and the static rows' V cross PCIe.

V as int8 codes (coded: kernels.v_codes.CodedV; K in HBM only): v_host holds each row's context's
V as its artifact's int8 codes (128 B a row at head_dim 128, not 256; the scale per token and head
in HBM, offload_v.py), decoded where read by the loader's arithmetic (the resident slot's bits);
positions from the row's context length on (its question and answer, bf16 from the model) are read
from a bf16 tail in HBM. Misses are written into the slot cache decoded, so hits read what a
resident slot holds."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ctxcache.kernels.carried_attention import NEG
from ctxcache.kernels.load_kernels import _KIND
from ctxcache.kernels.split_k_attention import (INTERPRET, empty_partial, group_queries, merge_partials,
                                               online_softmax_step, padded_group, partial_workspace, split_range,
                                               sparse_attention_ref, store_partial)
from ctxcache.kernels.v_codes import CodedV, decode_v, full_v_ref


def offload_attention_ref(q, k_host, v_host, k_cache, v_cache, idx, slot, k_sel, n, sinks: int,
                          recent: int, coded: CodedV | None = None) -> torch.Tensor:
    """Reference: the attention reads hits from the cache and the rest from the host, and the
    misses' rows are copied into their cache slots (in place); k_cache None: K read from k_host
    alone, the cache holds V; coded: v_host are int8 codes, a position's V is its decoded code
    before the row's start and the tail's row from it (v_codes.full_v_ref); idx -1: no key
    (reselect's carried rows pad their candidates so). Returns [B, Hq, D]."""
    kh = k_host.to(q.device).clone()
    vsrc = v_host if coded is None else full_v_ref(v_host, coded, v_cache.dtype)
    vh = vsrc.to(q.device).clone()
    for b in range(q.shape[0]):
        for h in range(k_host.shape[1]):
            for j in range(int(k_sel[b])):
                p, s = int(idx[b, h, j]), int(slot[b, h, j])
                if p < 0:  # no key (a carried row's padding)
                    continue
                if s >= 0:  # a hit is whatever the cache holds
                    vh[b, h, p] = v_cache[b, h, s].to(vh)
                    if k_cache is not None:
                        kh[b, h, p] = k_cache[b, h, s].to(kh)
                else:
                    v_cache[b, h, -s - 1] = vsrc[b, h, p]
                    if k_cache is not None:
                        k_cache[b, h, -s - 1] = k_host[b, h, p]
    return sparse_attention_ref(q, kh, vh, idx, k_sel, n, sinks, recent)


@triton.jit
def _offload_kernel(q_ptr, kh_ptr, vh_ptr, kc_ptr, vc_ptr, idx_ptr, slot_ptr, ksel_ptr, n_ptr, o_ws, ml_ws,
                    vs_ptr, vt_ptr, start_ptr, kind_ptr,
                    HKV, G, SINKS, RECENT, TAIL, scale_log2,
                    sq_b, sq_h, sk_b, sk_h, sk_s, sc_b, sc_h, sc_s, si_b, si_h,
                    sv_b, sv_h, sv_s, ss_b, ss_h, st_b, st_h, st_s,
                    SPLITS: tl.constexpr, IEEE: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                    BLOCK_N: tl.constexpr, K_HBM: tl.constexpr, V_CODES: tl.constexpr, OUT: tl.constexpr):
    row = tl.program_id(0)
    split = tl.program_id(1)
    b = row // HKV
    hkv = row % HKV
    n = tl.load(n_ptr + b)
    b64 = b.to(tl.int64)
    lo, hi, n_static, start, end = split_range(n, tl.load(ksel_ptr + b), split, SINKS, RECENT, SPLITS, BLOCK_N,
                                               False)
    offs_d = tl.arange(0, D)
    q = group_queries(q_ptr, b, hkv, G, sq_b, sq_h, G_PAD, D)
    _, l_i, acc = empty_partial(G_PAD, D)
    m_i = tl.full((G_PAD,), NEG, tl.float32)  # finite: a block of padding alone (idx -1) stays NaN-free
    host_base = b64 * sk_b + hkv * sk_h
    v_base = b64 * sv_b + hkv * sv_h
    cache_base = b64 * sc_b + hkv * sc_h
    if V_CODES:
        ctx = tl.load(start_ptr + b)  # the row's context length: the tail holds the positions from it
        kind = tl.load(kind_ptr + b)
    for t0 in range(start, end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        valid = t < end
        is_sel = valid & (t >= n_static)
        static_pos = tl.where(t < lo, t, hi + t - lo)
        sel = tl.load(idx_ptr + b * si_b + hkv * si_h + (t - n_static), mask=is_sel, other=0)
        valid = valid & (sel >= 0)  # -1: no key (a carried row's padding), neither read nor cached
        is_sel = is_sel & (sel >= 0)
        slot = tl.load(slot_ptr + b * si_b + hkv * si_h + (t - n_static), mask=is_sel, other=-1)
        pos = tl.where(valid, tl.where(t < n_static, static_pos, sel), 0)
        hit = is_sel & (slot >= 0)
        from_host = valid & (slot < 0)  # static rows carry slot -1 too
        cslot = tl.where(hit, slot, 0).to(tl.int64)
        pos64 = pos.to(tl.int64)
        hoff = host_base + pos64[:, None] * sk_s + offs_d[None, :]
        coff = cache_base + cslot[:, None] * sc_s + offs_d[None, :]
        # masked loads: only the rows each source owns cross PCIe or HBM
        if K_HBM:  # every key's K from its HBM buffer
            kb = tl.load(kh_ptr + hoff, mask=valid[:, None], other=0.0)
        else:
            kb = tl.where(hit[:, None], tl.load(kc_ptr + coff, mask=hit[:, None], other=0.0),
                          tl.load(kh_ptr + hoff, mask=from_host[:, None], other=0.0))
        if V_CODES:  # the context's positions as codes from the host, the rest from the HBM tail
            coded = from_host & (pos < ctx)
            code = tl.load(vh_ptr + v_base + pos64[:, None] * sv_s + offs_d[None, :], mask=coded[:, None], other=0)
            scale = tl.load(vs_ptr + b64 * ss_b + hkv * ss_h + pos64, mask=coded, other=0.0)
            decoded = decode_v(code, scale, kind, OUT).to(vc_ptr.dtype.element_ty)
            tailed = from_host & (pos >= ctx) & (pos - ctx < TAIL)
            tpos = tl.where(tailed, pos - ctx, 0).to(tl.int64)
            recent_v = tl.load(vt_ptr + b64 * st_b + hkv * st_h + tpos[:, None] * st_s + offs_d[None, :],
                               mask=tailed[:, None], other=0.0)
            vhost = tl.where(coded[:, None], decoded, recent_v)
        else:
            vhost = tl.load(vh_ptr + v_base + pos64[:, None] * sv_s + offs_d[None, :], mask=from_host[:, None],
                            other=0.0)
        vb = tl.where(hit[:, None], tl.load(vc_ptr + coff, mask=hit[:, None], other=0.0), vhost)
        miss = is_sel & (slot < 0)
        dst = tl.where(miss, -slot - 1, 0).to(tl.int64)
        doff = cache_base + dst[:, None] * sc_s + offs_d[None, :]
        if not K_HBM:
            tl.store(kc_ptr + doff, kb, mask=miss[:, None])
        tl.store(vc_ptr + doff, vb, mask=miss[:, None])
        m_i, l_i, acc = online_softmax_step(q, kb, vb, valid, m_i, l_i, acc, scale_log2, IEEE)
    store_partial(o_ws, ml_ws, row * SPLITS + split, m_i, l_i, acc, G, G_PAD, D)


def offload_attention(q, k_host, v_host, k_cache, v_cache, idx, slot, k_sel, n, sinks: int, recent: int,
                      splits: int = 16, out=None, ws=None, block_n: int = 64,
                      coded: CodedV | None = None) -> torch.Tensor:
    """q [B, Hq, D] (GPU); k/v_host [B, Hkv, S, D] pinned host (or any memory the kernel can
    address); k/v_cache [B, Hkv, C, D] GPU slots (k_cache None: K in HBM, read from k_host, the
    cache holds V); idx, slot [B, Hkv, K_max] int32 with equal strides (idx -1: no key); k_sel, n [B] int32.
    coded (K in HBM only): v_host [B, Hkv, S, D] int8 codes, the rest in CodedV (v_codes.py).
    Misses are written into the cache. -> [B, Hq, D]."""
    k_hbm = k_cache is None
    k_cache = v_cache if k_hbm else k_cache  # never read or written with K_HBM
    b, hq, d = q.shape
    hkv = k_host.shape[1]
    if (k_host.shape[:2] != (b, hkv) or v_host.shape != k_host.shape or k_cache.shape[:2] != (b, hkv)
            or v_cache.shape != k_cache.shape or k_host.shape[3] != d or k_cache.shape[3] != d or hq % hkv):
        raise ValueError(f"q {tuple(q.shape)}, host {tuple(k_host.shape)}, cache {tuple(k_cache.shape)} disagree")
    if v_cache.stride() != k_cache.stride() or v_host.stride(3) != 1:
        raise ValueError("K and V must share the cache's strides, and host V rows be contiguous")
    if (idx.shape != slot.shape or idx.stride() != slot.stride() or idx.dtype != torch.int32
            or slot.dtype != torch.int32 or idx.stride(2) != 1 or idx.shape[:2] != (b, hkv)):
        raise ValueError(f"idx {tuple(idx.shape)} and slot {tuple(slot.shape)} must be int32 [{b}, {hkv}, K], same strides")
    if (q.stride(2) != 1 or k_host.stride(3) != 1 or k_cache.stride(3) != 1 or d & (d - 1) or d < 16
            or splits & (splits - 1)):
        raise ValueError("need contiguous head dims, a power-of-two head_dim >= 16 and power-of-two splits")
    codes = _coded_args(coded, v_host, v_cache, k_hbm, b, hkv)
    g = hq // hkv
    g_pad = padded_group(g)
    ws = partial_workspace(b, hq, hkv, splits, d, q.device) if ws is None else ws
    out = torch.empty_like(q) if out is None else out
    _offload_kernel[(b * hkv, splits)](
        q, k_host, v_host, k_cache, v_cache, idx, slot, k_sel, n, ws[0], ws[1], *codes[:4],
        hkv, g, sinks, recent, codes[4], d ** -0.5 * 1.4426950408889634,
        q.stride(0), q.stride(1), *k_host.stride()[:3], *k_cache.stride()[:3], idx.stride(0), idx.stride(1),
        *v_host.stride()[:3], *codes[5:],
        SPLITS=splits, IEEE=q.dtype == torch.float32 or INTERPRET, G_PAD=g_pad, D=d, BLOCK_N=block_n,
        K_HBM=k_hbm, V_CODES=coded is not None, OUT=_KIND.get(v_cache.dtype, 0))
    return merge_partials(ws, out, hkv, splits)


def _coded_args(coded: CodedV | None, v_host: torch.Tensor, v_cache: torch.Tensor, k_hbm: bool, b: int,
                hkv: int) -> tuple:
    """(scales, tail, start, kind, tail length, scale strides (b, h), tail strides (b, h, s)) for
    the kernel; without codes placeholders (never read: V_CODES is a compile-time branch)."""
    if coded is None:
        return (v_host, v_host, v_host, v_host, 0, 0, 0, 0, 0, 0)
    sc, tail = coded.scales, coded.tail
    if not k_hbm or v_host.dtype != torch.int8 or tail.dtype != v_cache.dtype:
        raise ValueError(f"coded V needs K in HBM, int8 codes (not {v_host.dtype}) and a tail of the cache's "
                         f"dtype (not {tail.dtype})")
    if (sc.shape != v_host.shape[:3] or sc.stride(2) != 1 or tail.shape[:2] != (b, hkv)
            or tail.shape[3] != v_host.shape[3] or tail.stride(3) != 1
            or coded.start.shape != (b,) or coded.kind.shape != (b,)
            or coded.start.dtype != torch.int32 or coded.kind.dtype != torch.int32):
        raise ValueError(f"scales {tuple(sc.shape)}, tail {tuple(tail.shape)}, start and kind (int32 [{b}]) "
                         f"disagree with the codes {tuple(v_host.shape)}")
    return (sc, tail, coded.start, coded.kind, tail.shape[2], sc.stride(0), sc.stride(1), *tail.stride()[:3])
