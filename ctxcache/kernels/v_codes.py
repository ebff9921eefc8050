"""V held as its artifact's int8 codes (kv_codec "int8": codes [Hkv, N, D] int8, a scale per token
and KV head [Hkv, N] fp16) and decoded where it is read, by the loader's arithmetic.

Why: an offloaded context's host slot held V decoded to bf16 (256 B a token and KV head at
Llama-3.1-8B's head_dim); its codes are 130 B, and every byte of an offloaded context's V crosses
PCIe at a hot admission (2.2 GB at 32K) or as a decode step's slot-cache misses. Decoding is a
multiply, so a reader that decodes what it reads gets the resident slot's bits at 0.51x the bytes.

The arithmetic is load_kernels.dequant_into's (and kv_codec.decode_kv's): code x scale in fp32 (an
int8 x fp16 product is exact in fp32), rounded to the artifact's decoded dtype (its kv_dtype:
`kind`, 0 fp32, 1 fp16, 2 bf16), then to the cache's. `kind` is a per-row device value in the
kernels (artifacts of either kv_dtype share a pool and a compilation).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ctxcache.kernels.load_kernels import _KIND, _round_to

DTYPE_OF_KIND = {kind: dtype for dtype, kind in _KIND.items()}


def kind_of(dtype: torch.dtype) -> int:
    """The kernels' code of a decoded dtype (ValueError naming it where none)."""
    if dtype not in _KIND:
        raise ValueError(f"int8 V decodes to fp32, fp16 or bf16, not {dtype}")
    return _KIND[dtype]


class CodedV(NamedTuple):
    """What a reader of coded V needs beside the codes [B, Hkv, S, D] int8 (host): scales
    [B, Hkv, S] fp16 (HBM, offload_v.CodedHostKVPool), the bf16 tail [B, Hkv, T, D] (HBM) of the
    positions from each row's context length on, start [B] int32 (each row's context length: the
    first position the tail holds) and kind [B] int32 (each row's artifact's decoded dtype)."""

    scales: torch.Tensor
    tail: torch.Tensor
    start: torch.Tensor
    kind: torch.Tensor


def decode_v_ref(codes: torch.Tensor, scales: torch.Tensor, kind: int, dtype: torch.dtype) -> torch.Tensor:
    """codes [..., N, D] int8, scales [..., N] -> [..., N, D] `dtype`: fp32 code x scale, rounded
    to DTYPE_OF_KIND[kind], then to `dtype` (the loader's decode then the cache's copy)."""
    x = codes.float() * scales.float()[..., None]
    return x.to(DTYPE_OF_KIND[kind]).to(dtype)


def decode_v_into(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, kind: int) -> None:
    """out [Hkv, N, D] = decode_v_ref(codes [Hkv, N, D], scales [Hkv, N]): on a GPU one
    load_kernels.dequant_into launch (the kernel the loader decodes a resident slot's V by), on a
    CPU torch."""
    if out.is_cuda:
        from ctxcache.kernels.load_kernels import dequant_into
        dequant_into(codes, scales, out, 1, DTYPE_OF_KIND[kind])
        return
    out.copy_(decode_v_ref(codes, scales, kind, out.dtype))


def full_v_ref(codes: torch.Tensor, coded: CodedV, dtype: torch.dtype) -> torch.Tensor:
    """Every position's V [B, Hkv, S, D] as a reader sees it: decoded codes before each row's
    start, the tail from it (as far as it reaches; zeros after). The kernels' torch reference."""
    b, hkv, s, d = codes.shape
    out = torch.zeros(b, hkv, s, d, dtype=dtype, device=coded.tail.device)
    for i in range(b):
        c, kind = int(coded.start[i]), int(coded.kind[i])
        out[i, :, :c] = decode_v_ref(codes[i, :, :c], coded.scales[i, :, :c], kind, dtype).to(out.device)
        t = max(0, min(s - c, coded.tail.shape[2]))
        out[i, :, c:c + t] = coded.tail[i, :, :t]
    return out


@triton.jit
def decode_v(code, scale, kind, OUT: tl.constexpr):
    """[BLOCK_N, D] codes and [BLOCK_N] scales -> values rounded to OUT's precision (fp32 held):
    decode_v_ref's arithmetic, `kind` a runtime scalar (both roundings computed, one kept)."""
    x = code.to(tl.float32) * scale.to(tl.float32)[:, None]
    x = tl.where(kind == 1, _round_to(x, 1), tl.where(kind == 2, _round_to(x, 2), x))
    return _round_to(x, OUT)

