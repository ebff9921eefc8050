"""The transformer block's glue on the GPU in fewer launches: RMSNorm, the residual add fused
with the RMSNorm after it, and the MLP's SiLU(gate) x up over its one gate+up GEMM output.

Why: in a captured decode step each of these is a launch that costs more than its bytes. On the
H200 (Llama-3.1-8B bf16, 32K x 8, step_profile at a49a4b5) torch's RMSNorm took 5.8 us a launch
(65 a step; 6.0 at batch 1), a residual add 1.45, SiLU 1.9 and the product 1.6: 0.59 ms of a 9.24 ms
sparse step in 225 launches. This one: 2.0 us a norm, with or without the add.

Arithmetic as the torch path: the residual sum rounded once to the model's dtype (torch's bf16
add), the norm in fp32 from that rounded sum, rounded once; SiLU rounded before the product as
torch rounds F.silu's output. Only the order of the fp32 sum of squares differs.

x [R, N] (rows may have any stride, N contiguous), weight [N]."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Torch reference (the model's CPU path)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def add_rms_norm_ref(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)) as torch computes them one after the other."""
    total = x + delta
    return total, rms_norm_ref(total, weight, eps)


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2I] -> SiLU(gate) * up [..., I] (gate first)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


@triton.jit
def _rms_norm_kernel(x_ptr, d_ptr, w_ptr, sum_ptr, out_ptr, N, sx, sd, ss, so, eps,
                     BLOCK: tl.constexpr, ADD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * sx + offs, mask=mask, other=0.0)
    if ADD:  # the residual stream keeps the sum rounded to its dtype, and the norm reads that
        x = (x.to(tl.float32) + tl.load(d_ptr + row * sd + offs, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row * ss + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * so + offs, (xf * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, I, sg, so, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    g = tl.load(gu_ptr + row * sg + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * sg + I + offs, mask=mask, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)  # F.silu's rounding
    tl.store(out_ptr + row * so + offs, (act * u).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    """x [..., N] as [R, N] (a view where the leading dims allow it)."""
    if x.stride(-1) != 1:
        raise ValueError(f"{name} {tuple(x.shape)} needs a contiguous last dimension")
    return x.reshape(-1, x.shape[-1])


def _warps(n: int) -> int:
    """Warps a row: 16 values a thread (4096 -> 8 warps)."""
    return max(1, min(16, triton.next_power_of_2(n) // 512))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """rms_norm(x) [..., N], or with delta (x's shape) (x + delta, rms_norm(x + delta)) in one launch."""
    n = x.shape[-1]
    if weight.shape != (n,) or (delta is not None and delta.shape != x.shape):
        raise ValueError(f"x {tuple(x.shape)}, weight {tuple(weight.shape)} and delta "
                         f"{None if delta is None else tuple(delta.shape)} disagree")
    x2 = _rows(x, "x")
    d2 = _rows(delta, "delta") if delta is not None else x2
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    total = torch.empty_like(out) if delta is not None else out
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, d2, weight, total, out, n, x2.stride(0), d2.stride(0), n, n, eps,
                                         BLOCK=triton.next_power_of_2(n), ADD=delta is not None, num_warps=_warps(n))
    return out if delta is None else (total, out)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2I] (gate, then up) -> SiLU(gate) * up [..., I] in one launch."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up {tuple(gate_up.shape)} must end in 2 x the MLP width")
    i = gate_up.shape[-1] // 2
    gu = _rows(gate_up, "gate_up")
    out = torch.empty(*gate_up.shape[:-1], i, dtype=gate_up.dtype, device=gate_up.device)
    block = min(2048, triton.next_power_of_2(i))
    if gu.shape[0]:
        _silu_mul_kernel[(gu.shape[0], triton.cdiv(i, block))](gu, out, i, gu.stride(0), i, BLOCK=block,
                                                               num_warps=_warps(block))
    return out
