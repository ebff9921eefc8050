"""Split-K (flash-decoding) attention of one query per head over sinks + selected + recent keys.

The keys a KV head reads form a virtual list: the static part (sinks [0, lo) and the recent
window [hi, n)) followed by the k selected middle indices. The list is cut into SPLITS
contiguous chunks, one program per (row, KV head, chunk), so a 5% selection still fills the
GPU; each program handles the whole GQA group (one K/V read per group) and writes a partial
(max, sum, output) that a second launch merges. DENSE=True reads [0, n) instead (the dense
split-K baseline and the graph-capturable dense decode)."""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from ctxcache.kernels.sync import launch_opts, pdl_enter, pdl_wait
from ctxcache.models.attention import gather_attention

# Triton 3.6's CPU interpreter computes bf16 tl.dot wrongly (seen: errors of 1e10), so under
# TRITON_INTERPRET the kernel upcasts to fp32 dots; compiled GPU code uses native bf16 dots.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def region(n: torch.Tensor, sinks: int, recent: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Budget.region per row: lo = min(sinks, n), hi = max(lo, n - recent); int32 [B]."""
    lo = torch.clamp(n, max=sinks)
    return lo.int(), torch.maximum(lo, n - recent).int()


def sparse_attention_ref(q, k_cache, v_cache, idx, k_sel, n, sinks: int, recent: int) -> torch.Tensor:
    """Per row: gather_attention over [sinks, recent, idx[:k_sel]] (-1 in idx: no key). q [B, Hq, D] -> [B, Hq, D]."""
    outs = []
    for b in range(q.shape[0]):
        nb, kb = int(n[b]), int(k_sel[b])
        lo, hi = min(sinks, nb), max(min(sinks, nb), nb - recent)
        static = torch.cat([torch.arange(lo), torch.arange(hi, nb)]).to(q.device)
        sel = torch.cat([static.expand(k_cache.shape[1], -1), idx[b, :, :kb].long().to(q.device)], dim=1)
        outs.append(gather_attention(q[b], k_cache[b], v_cache[b], sel.clamp(min=0), sel >= 0))
    return torch.stack(outs)


@triton.jit
def online_softmax_step(q, kb, vb, valid, m_i, l_i, acc, scale_log2, IEEE: tl.constexpr):
    """One block of keys into the running (max, sum, output) of the group's queries q [G_PAD, D]:
    kb, vb [BLOCK_N, D], valid [BLOCK_N] (invalid keys weigh 0). IEEE: fp32 dots (fp32 inputs, and
    the CPU interpreter, whose bf16 dots are wrong); else native dots in the cache's dtype."""
    s = block_logits(q, kb, valid, scale_log2, IEEE)
    return online_softmax_update(s, vb, m_i, l_i, acc, IEEE)


@triton.jit
def block_logits(q, kb, valid, scale_log2, IEEE: tl.constexpr):
    """The group's logits [G_PAD, BLOCK_N] of a block of keys, in log2 units (-inf: invalid)."""
    if IEEE:
        s = tl.dot(q.to(tl.float32), tl.trans(kb.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(kb))
    return tl.where(valid[None, :], s * scale_log2, float("-inf"))


@triton.jit
def online_softmax_update(s, vb, m_i, l_i, acc, IEEE: tl.constexpr):
    """block_logits s [G_PAD, BLOCK_N] and their values vb [BLOCK_N, D] into the running partial."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, vb.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb)
    return m_new, l_i, acc


@triton.jit
def group_queries(q_ptr, b, hkv, G, sq_b, sq_h, G_PAD: tl.constexpr, D: tl.constexpr):
    """The G queries of KV head hkv of batch element b as [G_PAD, D] (padding rows 0: tl.dot
    needs 16 rows)."""
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D)
    return tl.load(q_ptr + b * sq_b + (hkv * G + offs_g)[:, None] * sq_h + offs_d[None, :],
                   mask=(offs_g < G)[:, None], other=0.0)


@triton.jit
def empty_partial(G_PAD: tl.constexpr, D: tl.constexpr):
    """(max, sum, output) of no keys yet: -inf, 0, 0."""
    return (tl.full((G_PAD,), float("-inf"), tl.float32), tl.zeros((G_PAD,), tl.float32),
            tl.zeros((G_PAD, D), tl.float32))


@triton.jit
def store_partial(o_ws, ml_ws, slot, m_i, l_i, acc, G, G_PAD: tl.constexpr, D: tl.constexpr):
    """Partial `slot`'s (max, sum, output) for merge_partials; the G_PAD - G padding rows are
    never merged, so not stored."""
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D)
    base = slot * G_PAD
    real = offs_g < G
    tl.store(o_ws + (base + offs_g)[:, None] * D + offs_d[None, :], acc, mask=real[:, None])
    tl.store(ml_ws + (base + offs_g) * 2, m_i, mask=real)
    tl.store(ml_ws + (base + offs_g) * 2 + 1, l_i, mask=real)


@triton.jit
def split_range(n, k_sel, split, SINKS, RECENT, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, DENSE: tl.constexpr):
    """This split's chunk [start, end) of a row's virtual key list (static keys, then the k_sel
    selected ones; [0, n) where DENSE), in whole BLOCK_N blocks, and the static part's bounds
    (lo, hi, n_static): sinks [0, lo), recent window [hi, n)."""
    lo = tl.minimum(n, SINKS)
    hi = tl.maximum(lo, n - RECENT)
    n_static = lo + n - hi
    if DENSE:
        total = n
    else:
        total = n_static + k_sel
    chunk = tl.cdiv(tl.cdiv(total, SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    return lo, hi, n_static, start, tl.minimum(start + chunk, total)


@triton.jit
def _split_kernel(q_ptr, k_ptr, v_ptr, idx_ptr, ksel_ptr, n_ptr, o_ws, ml_ws,
                  HKV, G, SINKS, RECENT, scale_log2,
                  sq_b, sq_h, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, si_b, si_h,
                  SPLITS: tl.constexpr, DENSE: tl.constexpr, IEEE: tl.constexpr,
                  G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr,
                  PRE_WAIT: tl.constexpr = True):
    if not PRE_WAIT:
        pdl_enter(USE_PDL)
    row = tl.program_id(0)
    split = tl.program_id(1)
    b = row // HKV
    hkv = row % HKV
    n = tl.load(n_ptr + b)
    b64 = b.to(tl.int64)  # caches of 8 x 128K tokens are near 2^31 elements
    if DENSE:
        k_sel = 0
    else:
        k_sel = tl.load(ksel_ptr + b)
    lo, hi, n_static, start, end = split_range(n, k_sel, split, SINKS, RECENT, SPLITS, BLOCK_N, DENSE)
    offs_d = tl.arange(0, D)
    q = group_queries(q_ptr, b, hkv, G, sq_b, sq_h, G_PAD, D)
    if PRE_WAIT:  # n, k and q come from before the step's first launch (sync.py): read them while
        pdl_enter(USE_PDL)  # the selection finishes; only idx needs the wait
    m_i, l_i, acc = empty_partial(G_PAD, D)
    for t0 in range(start, end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        valid = t < end
        if DENSE:
            pos = t
        else:
            static_pos = tl.where(t < lo, t, hi + t - lo)
            sel = tl.load(idx_ptr + b * si_b + hkv * si_h + (t - n_static),
                          mask=valid & (t >= n_static), other=0)
            pos = tl.where(t < n_static, static_pos, sel)
        pos = tl.where(valid, pos, 0)
        kb = tl.load(k_ptr + b64 * sk_b + hkv * sk_h + pos[:, None].to(tl.int64) * sk_s + offs_d[None, :])
        vb = tl.load(v_ptr + b64 * sv_b + hkv * sv_h + pos[:, None].to(tl.int64) * sv_s + offs_d[None, :])
        m_i, l_i, acc = online_softmax_step(q, kb, vb, valid, m_i, l_i, acc, scale_log2, IEEE)
    store_partial(o_ws, ml_ws, row * SPLITS + split, m_i, l_i, acc, G, G_PAD, D)


@triton.jit
def _merge_kernel(o_ws, ml_ws, out_ptr, HKV, G, so_b, so_h,
                  SPLITS: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, USE_PDL: tl.constexpr,
                  TRIGGER: tl.constexpr = True):
    """Combine the SPLITS partials (max, sum, output) of one query head: program (row, g)."""
    if TRIGGER:  # let the successor launch (and do its pre-wait loads) once this one waited
        pdl_enter(USE_PDL)
    else:
        pdl_wait(USE_PDL)
    pid = tl.program_id(0)
    row = pid // G
    g = pid % G
    offs_s = tl.arange(0, SPLITS)
    offs_d = tl.arange(0, D)
    base = (row * SPLITS + offs_s) * G_PAD + g
    m = tl.load(ml_ws + base * 2)
    l = tl.load(ml_ws + base * 2 + 1)
    m_all = tl.max(m, axis=0)
    w = tl.where(m > float("-inf"), tl.exp2(m - m_all), 0.0)
    o = tl.load(o_ws + base[:, None] * D + offs_d[None, :])
    res = tl.sum(o * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    b = row // HKV
    h = (row % HKV) * G + g
    tl.store(out_ptr + b * so_b + h * so_h + offs_d, res.to(out_ptr.dtype.element_ty))


def choose_splits(rows: int, max_keys: int, sms: int = 132, min_keys: int = 128, waves: int = 2) -> int:
    """Power-of-two chunks so that rows x splits covers the GPU about `waves` times, each >= min_keys."""
    want = max(1, (waves * sms) // max(rows, 1))
    cap = max(1, max_keys // min_keys)
    return 1 << int(math.log2(max(1, min(want, cap, 256))))


def sparse_decode_attention(q, k_cache, v_cache, n, idx=None, k_sel=None, sinks: int = 0, recent: int = 0,
                            splits: int = 16, out=None, ws=None, block_n: int = 64, pdl: bool = False,
                            num_warps: int = 4, num_stages: int | None = None, pre_wait: bool = True) -> torch.Tensor:
    """q [B, Hq, D]; k/v_cache [B, Hkv, S, D]; n [B] int32 (cached keys per row); idx [B, Hkv, K_max]
    int32 and k_sel [B] int32 (selected middle keys; None: dense over [0, n)) -> [B, Hq, D].

    pdl: programmatic dependent launch (sync.pdl_available). num_warps / num_stages: the split
    kernel's launch shape (num_stages None: Triton's default software-pipelining depth). pre_wait:
    with pdl, load n, k_sel and q before waiting for the predecessor (they must come from before
    the step's first launch, see sync.py); only idx waits; the merge then lets its successor
    launch early."""
    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    if k_cache.shape[0] != b or v_cache.shape != k_cache.shape or k_cache.shape[3] != d or hq % hkv:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k_cache.shape)}, v {tuple(v_cache.shape)} disagree")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1 or d & (d - 1) or d < 16:
        raise ValueError(f"need contiguous head dims and a power-of-two head_dim >= 16, got {d}")
    if n.shape != (b,) or n.dtype != torch.int32:
        raise ValueError(f"n {tuple(n.shape)} {n.dtype} must be int32 [{b}]")
    dense = idx is None
    if not dense and (idx.shape[:2] != (b, hkv) or idx.dtype != torch.int32 or idx.stride(2) != 1
                      or k_sel is None or k_sel.shape != (b,) or k_sel.dtype != torch.int32):
        raise ValueError(f"idx {tuple(idx.shape)} {idx.dtype} must be int32 [{b}, {hkv}, K] with k_sel int32 [{b}]")
    if splits & (splits - 1):
        raise ValueError(f"splits={splits} must be a power of two")
    g = hq // hkv
    g_pad = padded_group(g)
    ws = partial_workspace(b, hq, hkv, splits, d, q.device) if ws is None else ws
    out = torch.empty_like(q) if out is None else out
    idx_t = idx if not dense else n  # unused pointer in dense mode
    si = idx.stride() if not dense else (0, 0)
    _split_kernel[(b * hkv, splits)](
        q, k_cache, v_cache, idx_t, k_sel if not dense else n, n, ws[0], ws[1],
        hkv, g, sinks, recent, d ** -0.5 * 1.4426950408889634,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], si[0], si[1],
        SPLITS=splits, DENSE=dense, IEEE=q.dtype == torch.float32 or INTERPRET, G_PAD=g_pad, D=d, BLOCK_N=block_n,
        USE_PDL=pdl, PRE_WAIT=pre_wait, num_warps=num_warps,
        **launch_opts(pdl),
        **({"num_stages": num_stages} if num_stages else {}))
    return merge_partials(ws, out, hkv, splits, pdl, trigger=pre_wait)


def padded_group(g: int) -> int:
    """Query heads per KV head padded for tl.dot (>= 16 rows): the partials' row stride."""
    return max(16, triton.next_power_of_2(g))


def partial_workspace(batch: int, hq: int, hkv: int, splits: int, d: int,
                      device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """The split programs' partials: outputs [rows x splits x G_PAD, D] and (max, sum) pairs, fp32."""
    rows = batch * hkv * splits * padded_group(hq // hkv)
    return (torch.empty(rows * d, dtype=torch.float32, device=device),
            torch.empty(rows * 2, dtype=torch.float32, device=device))


def merge_partials(ws: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor, hkv: int, splits: int,
                   pdl: bool = False, num_warps: int = 1, trigger: bool = True) -> torch.Tensor:
    """Combine the split programs' partials in ws (outputs, then max and sum per query head, as
    the split kernels store them) into out [B, Hq, D]. One program per query head; 1 warp keeps
    its reductions inside a warp (H100: 0.7-1.7 us per 128K step faster than 4,
    bench/attn_parts_probe.py at d74d176). trigger (with pdl): let the next PDL launch start as soon as this
    one's wait returned (else at its exit), so it can do its pre-wait loads meanwhile."""
    b, hq, d = out.shape
    g = hq // hkv
    _merge_kernel[(b * hq,)](ws[0], ws[1], out, hkv, g, out.stride(0), out.stride(1), SPLITS=splits,
                             G_PAD=padded_group(g), D=d, USE_PDL=pdl, TRIGGER=trigger, num_warps=num_warps,
                             **launch_opts(pdl))
    return out
