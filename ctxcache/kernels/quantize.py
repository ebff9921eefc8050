"""Per-row int8 quantization of dense tables, one program per row (the GPU index build).

Why: methods/int8_tables.quantize_rows in torch makes about eight passes over fp32 copies of a
layer's dense rows (Hkv x m x C rows of N keys: 1 GB of fp32 per copy at 32K, Llama-3.1-8B
shapes). Since int8 tables became the default that doubled the GPU build at 32K (H100: 189 ->
374 ms for 32 layers, bench decode). Here each program reads its fp16 row twice (the absmax,
then the quantization) and writes int8 and the scale: the same arithmetic bit for bit (IEEE
division, round half to even), so the built tables equal the torch ones.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ctxcache.kernels.sync import INTERPRET
from ctxcache.methods.int8_tables import quantize_rows


@triton.jit
def _round_half_even(y):
    """torch.round of fp32 y (|y| < 2^23): y - floor(y) is exact there."""
    r = tl.floor(y)
    f = y - r
    up = (f > 0.5) | ((f == 0.5) & ((r.to(tl.int32) & 1) == 1))
    return r + up.to(tl.float32)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = row * N
    amax = tl.zeros((BLOCK,), tl.float32)
    for n0 in range(0, N, BLOCK):
        offs = n0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + base + offs, mask=offs < N, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), 1e-8), 127.0)
    tl.store(s_ptr + row, scale)
    for n0 in range(0, N, BLOCK):
        offs = n0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + base + offs, mask=offs < N, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(_round_half_even(tl.math.div_rn(x, scale)), -127.0), 127.0)
        tl.store(q_ptr + base + offs, q.to(tl.int8), mask=offs < N)


def quantize_rows_fused(dense: torch.Tensor, block: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows (fp16 [..., N] -> int8 [..., N], fp32 scale [...]) in one launch where
    kernels run (a GPU, or the CPU interpreter); torch's quantize_rows elsewhere."""
    if not (dense.is_cuda or INTERPRET):
        return quantize_rows(dense)
    if dense.dtype != torch.float16:
        raise ValueError(f"dense {dense.dtype} must be float16")
    x = dense.contiguous()
    n = x.shape[-1]
    rows = x.numel() // max(n, 1)
    q = torch.empty(x.shape, dtype=torch.int8, device=x.device)
    scale = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    if rows and n:
        _quantize_rows_kernel[(rows,)](x, q, scale, n, BLOCK=block, num_warps=4)
    return q, scale
