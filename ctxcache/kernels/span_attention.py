"""The packed prefill's spans in one Triton launch: each (span, KV head, block of rows) program
attends its span's keys online and writes its output and log-sum-exp, as flash attention does
for models/packed_attention.py (attend_with_lse), where the launch shape is ours to choose.

Why: on the H200 the flash path took 83 us a layer for a 32-token question over 32K keys (its
split-KV kernel, its combine and span_merge; admit_profile_resident_h200) against 35 us for the
layer's K/V at the copy rate: it reads each KV head's keys once, but at half the card's bandwidth.
A program here holds its rows' queries (the group's heads x the prompt's tokens) and streams its
span's K/V blocks once; `SPAN_KERNEL` in packed_attention picks it once measured faster.

rows [Hkv, R, D] (any dtype Triton loads), k / v [P, Hkv, L, D] views (the context cut into P
spans of L keys, strides free but a contiguous last dim) -> out [P, Hkv, R, D] in rows' dtype
and lse [P, Hkv, R] fp32 (natural log of the sum of exp(scaled logit)), unmasked. Its torch
reference is the path it replaces: packed_attention.attend_with_lse over the rows expanded to
every span (fp32 math off a GPU)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ctxcache.kernels.split_k_attention import INTERPRET

LOG2E = 1.4426950408889634
BLOCK_M = 128  # packed rows a program: a 32-token question of 4 heads a KV head in one
BLOCK_N = 64  # keys a step
NUM_WARPS = 8
NUM_STAGES = 3


# the row count follows the prompt's length and the key count the context's: neither may compile a
# kernel of its own (divisibility by 16 is a specialization Triton otherwise keys on)
@triton.jit(do_not_specialize=["R", "L"])
def _span_attention_kernel(q_ptr, sq_h, sq_r, k_ptr, sk_p, sk_h, sk_n, v_ptr, sv_p, sv_h, sv_n,
                           o_ptr, so_p, so_h, so_r, lse_ptr, sl_p, sl_h, R, L, HKV, scale_log2,
                           D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    pid, blk = tl.program_id(0), tl.program_id(1)
    p, h = pid // HKV, pid % HKV
    r = blk * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    live = r < R
    q = tl.load(q_ptr + h * sq_h + r[:, None] * sq_r + d[None, :], mask=live[:, None], other=0.0)
    k_base = k_ptr + p.to(tl.int64) * sk_p + h.to(tl.int64) * sk_h
    v_base = v_ptr + p.to(tl.int64) * sv_p + h.to(tl.int64) * sv_h
    top = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    norm = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    for start in range(0, L, BLOCK_N):  # every span holds >= one key: top is finite after the first step
        j = start + tl.arange(0, BLOCK_N)
        seen = j < L
        kb = tl.load(k_base + j[:, None].to(tl.int64) * sk_n + d[None, :], mask=seen[:, None], other=0.0)
        vb = tl.load(v_base + j[:, None].to(tl.int64) * sv_n + d[None, :], mask=seen[:, None], other=0.0)
        if IEEE:
            s = tl.dot(q.to(tl.float32), tl.trans(kb.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(kb))
        s = tl.where(seen[None, :], s * scale_log2, float("-inf"))
        new_top = tl.maximum(top, tl.max(s, 1))
        w = tl.exp2(s - new_top[:, None])
        fade = tl.exp2(top - new_top)
        norm = norm * fade + tl.sum(w, 1)
        if IEEE:
            acc = acc * fade[:, None] + tl.dot(w, vb.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * fade[:, None] + tl.dot(w.to(vb.dtype), vb)
        top = new_top
    out = acc / norm[:, None]
    tl.store(o_ptr + p.to(tl.int64) * so_p + h * so_h + r[:, None] * so_r + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=live[:, None])
    tl.store(lse_ptr + p * sl_p + h * sl_h + r, (top + tl.log2(norm)) / 1.4426950408889634, mask=live)


def span_attention(rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher (shapes as in the module docstring)."""
    hkv, r, d = rows.shape
    spans, hk, length = k.shape[:3]
    if k.shape != (spans, hkv, length, d) or v.shape != k.shape or length < 1 or d & (d - 1):
        raise ValueError(f"rows {tuple(rows.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} disagree "
                         f"(k, v [P, Hkv, L >= 1, D], D a power of two)")
    if any(t.stride(-1) != 1 for t in (rows, k, v)):
        raise ValueError("rows, k and v need a contiguous last dimension")
    out = torch.empty(spans, hkv, r, d, dtype=rows.dtype, device=rows.device)
    lse = torch.empty(spans, hkv, r, dtype=torch.float32, device=rows.device)
    _span_attention_kernel[(spans * hkv, triton.cdiv(r, BLOCK_M))](
        rows, rows.stride(0), rows.stride(1), k, k.stride(0), k.stride(1), k.stride(2),
        v, v.stride(0), v.stride(1), v.stride(2), out, out.stride(0), out.stride(1), out.stride(2),
        lse, lse.stride(0), lse.stride(1), r, length, hkv, d ** -0.5 * LOG2E, D=d, BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N, IEEE=rows.dtype == torch.float32 or INTERPRET, num_warps=NUM_WARPS,
        num_stages=NUM_STAGES)
    return out, lse
