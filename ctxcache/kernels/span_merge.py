"""The packed prefill's last step in one launch: the last keys' causal attention and the spans' merge.

models/packed_attention.py runs flash attention over the context's spans and gets each span's
output and log-sum-exp; what is left is the few keys after the spans (the context's leftover,
fewer than the span count, then the prompt's own, causal) and the merge of every partial by its
log-sum-exp. In torch (merge_ref) that is about twenty small kernels and fp32 copies of every
partial: ~90 us a layer at Llama-3.1-8B's shapes on an H100, more than the spans' flash saves at
32K. Here one program per (KV head, block of rows) attends the last keys online, folds the
partials in, and writes the output once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ctxcache.kernels.split_k_attention import INTERPRET

ROWS = 16  # packed rows a program: 8 KV heads x 128 rows are 64 programs, each folding every span in
KEYS = 32  # last keys a step


def merge_ref(rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor, t: int, outs: torch.Tensor,
              lses: torch.Tensor) -> torch.Tensor:
    """rows [Hkv, R, D] (row (g, i): prompt token i = row % t) over the last keys k, v [Hkv, L, D]
    (L - t of the context's, then the prompt's t: row (g, i) sees those up to token i), merged
    with the spans' outputs outs [P, Hkv, R, D] by their log-sum-exps lses [P, Hkv, R] (fp32)
    -> [Hkv, R, D] in rows' dtype. fp32 math."""
    n = k.shape[1]
    logits = torch.matmul(rows.float(), k.float().transpose(-1, -2)) * rows.shape[-1] ** -0.5
    token = torch.arange(rows.shape[1], device=rows.device) % t
    hidden = torch.arange(n, device=rows.device)[None, :] > (n - t + token)[:, None]
    logits = logits.masked_fill(hidden, float("-inf"))
    tail_lse = logits.logsumexp(-1)
    tail_out = torch.matmul((logits - tail_lse[..., None]).exp(), v.float())
    all_outs = torch.cat([outs.float(), tail_out[None]])
    all_lses = torch.cat([lses.float(), tail_lse[None]])
    weights = (all_lses - all_lses.amax(0, keepdim=True)).exp()
    return ((all_outs * weights[..., None]).sum(0) / weights.sum(0)[..., None]).to(rows.dtype)


# the lse's strides are the prompt's rows (group x tokens): an offloaded row's prompt is not padded
# to slot_prefill.PAD_TO, so their divisibility by 16 would compile a kernel per prompt length
# (the H200's test_no_kernel_compiles_after_serving[offload] caught one after SERVING)
@triton.jit(do_not_specialize=["R", "L", "T", "P", "sl_p", "sl_h"])
def _merge_kernel(rows_ptr, sr_h, sr_r, k_ptr, sk_h, sk_n, v_ptr, sv_h, sv_n, o_ptr, so_p, so_h, so_r,
                  lse_ptr, sl_p, sl_h, sl_r, dst_ptr, R, L, T, P, scale,
                  D: tl.constexpr, ROWS: tl.constexpr, KEYS: tl.constexpr, IEEE: tl.constexpr):
    h, blk = tl.program_id(0), tl.program_id(1)
    r = blk * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, D)
    live = r < R
    q = tl.load(rows_ptr + h * sr_h + r[:, None] * sr_r + d[None, :], mask=live[:, None], other=0.0)
    sees = L - T + r % T  # the last key row r sees (its own prompt token)
    top = tl.full((ROWS,), float("-inf"), tl.float32)
    norm = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, D), tl.float32)
    for start in range(0, L, KEYS):  # key 0 is seen by every row: top is finite after the first step
        j = start + tl.arange(0, KEYS)
        k = tl.load(k_ptr + h * sk_h + j[:, None] * sk_n + d[None, :], mask=(j < L)[:, None], other=0.0)
        v = tl.load(v_ptr + h * sv_h + j[:, None] * sv_n + d[None, :], mask=(j < L)[:, None], other=0.0)
        if IEEE:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(j[None, :] <= sees[:, None], s * scale, float("-inf"))
        new_top = tl.maximum(top, tl.max(s, axis=1))
        p = tl.exp(s - new_top[:, None])
        fade = tl.exp(top - new_top)
        norm = norm * fade + tl.sum(p, axis=1)
        acc = acc * fade[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        top = new_top
    for i in range(0, P):  # a span's output is its normalized sum: weight exp(lse - top)
        lse = tl.load(lse_ptr + i * sl_p + h * sl_h + r * sl_r, mask=live, other=0.0)
        out = tl.load(o_ptr + i * so_p + h * so_h + r[:, None] * so_r + d[None, :], mask=live[:, None], other=0.0)
        new_top = tl.maximum(top, lse)
        fade, weight = tl.exp(top - new_top), tl.exp(lse - new_top)
        norm = norm * fade + weight
        acc = acc * fade[:, None] + out.to(tl.float32) * weight[:, None]
        top = new_top
    res = acc / norm[:, None]
    tl.store(dst_ptr + (h * R + r[:, None]) * D + d[None, :], res.to(dst_ptr.dtype.element_ty), mask=live[:, None])


def merge(rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor, t: int, outs: torch.Tensor,
          lses: torch.Tensor) -> torch.Tensor:
    """merge_ref's result, in one launch (every input's last dim contiguous)."""
    hkv, r, d = rows.shape
    if any(x.stride(-1) != 1 for x in (rows, k, v, outs)) or d & (d - 1) or d < 16:
        raise ValueError(f"merge needs contiguous last dims and a power-of-two head dim >= 16, not {d}")
    dst = torch.empty(hkv, r, d, dtype=rows.dtype, device=rows.device)
    _merge_kernel[(hkv, triton.cdiv(r, ROWS))](
        rows, rows.stride(0), rows.stride(1), k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1),
        outs, outs.stride(0), outs.stride(1), outs.stride(2), lses, lses.stride(0), lses.stride(1), lses.stride(2),
        dst, r, k.shape[1], t, outs.shape[0], d ** -0.5, D=d, ROWS=ROWS, KEYS=KEYS,
        IEEE=rows.dtype == torch.float32 or INTERPRET)
    return dst
