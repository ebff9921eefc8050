"""What a context's load runs on the GPU: int8 K/V decoded straight from pinned host memory into
the cache, and CSAttention's int8 rows derived from the centroids and the keys in one launch.

Why (H200, 32K tokens, Llama-3.1-8B shapes, a 2.1 GB artifact in pinned DRAM): a load took 141 ms
for 39 ms of PCIe copy (55 GB/s): the torch decode of the codes (fp32 temporaries, ~8 passes a
layer) 60 ms with its copies, the rows 77 ms (an fp64 copy of the keys, an fp64 GEMM, the fp16
round, four passes of quantization). Here the K/V kernel reads the codes over PCIe once (UVA:
pinned host memory is addressable from kernels) and writes the cache once; the rows kernel reads
the keys twice (the row maximum, then the quantized rows) and writes int8 once.

Both compute exactly what their torch references compute (`kv_codec.decode_kv`,
`csattention_rows.dense_rows`): an int8 x fp16 product is exact in fp32 and rounds once to the
cache dtype; a row is the fp64 sum of d_b exact fp16 x key products, rounded to fp32 then fp16
(as torch's double -> half does), and quantized with IEEE division and round-half-even.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_RNE = tl.constexpr(12582912.0)  # 1.5 * 2^23: (x + _RNE) - _RNE rounds |x| < 2^22 to the nearest even integer


_KIND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


# ---- K/V codes -> cache ---------------------------------------------------------------------------

# lengths and the strides that follow them are not specialized: each context's length would
# otherwise pick its own compilation (divisibility by 16) while serving
@triton.jit(do_not_specialize=["N", "sc_h", "ss_h", "ss_n"])
def _dequant_kernel(code_ptr, scale_ptr, out_ptr, N, GROUP,
                    sc_h, sc_n, ss_h, ss_n, ss_d, so_h, so_n,
                    D: tl.constexpr, BLOCK_N: tl.constexpr, MID: tl.constexpr, OUT: tl.constexpr):
    h = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    ok = (t < N)[:, None]
    t64 = t.to(tl.int64)[:, None]
    code = tl.load(code_ptr + h * sc_h + t64 * sc_n + d[None, :], mask=ok, other=0)
    scale = tl.load(scale_ptr + h * ss_h + (t64 // GROUP) * ss_n + d[None, :] * ss_d, mask=ok, other=0.0)
    value = _round_to(_round_to(code.to(tl.float32) * scale.to(tl.float32), MID), OUT)
    tl.store(out_ptr + h * so_h + t64 * so_n + d[None, :], value.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _round_to(x, KIND: tl.constexpr):
    """fp32 x rounded (to nearest even) to KIND's precision, kept in fp32: 0 fp32, 1 fp16, 2 bf16
    (by hand: Triton's CPU interpreter truncates fp32 -> bf16)."""
    if KIND == 1:
        x = x.to(tl.float16).to(tl.float32)
    elif KIND == 2:
        bits = x.to(tl.uint32, bitcast=True)
        x = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return x


def dequant_into(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, group: int,
                 decoded: torch.dtype | None = None) -> None:
    """out [Hkv, N, D] = codes [Hkv, N, D] int8 * the scale of each element, which is
    scales[h, n // group, d] (keys: scales [Hkv, ceil(N/group), D]) or, for scales [Hkv, N]
    (values, group 1), scales[h, n]; rounded to `decoded` (the artifact's K/V dtype, default
    out's) first, then to out's, as decoding then copying does. codes and scales may be pinned
    host memory (read over PCIe)."""
    decoded = out.dtype if decoded is None else decoded
    hkv, n, d = codes.shape
    if codes.dtype != torch.int8 or out.shape != codes.shape or codes.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError(f"codes {codes.dtype} {tuple(codes.shape)} and out {tuple(out.shape)} must be int8 "
                         "and of one shape, each row contiguous")
    per_token = scales.dim() == 2
    ss = (scales.stride(0), scales.stride(1), 0) if per_token else tuple(scales.stride())
    block = 64 if d >= 128 else 128
    _dequant_kernel[(hkv, triton.cdiv(n, block))](codes, scales, out, n, 1 if per_token else group,
                                                  codes.stride(0), codes.stride(1), *ss, out.stride(0), out.stride(1),
                                                  D=d, BLOCK_N=block, MID=_KIND[decoded], OUT=_KIND[out.dtype])


def dequant_ok(codes: torch.Tensor, decoded: torch.dtype, out: torch.dtype) -> bool:
    """The kernel takes this layer (a power-of-two head_dim, float dtypes; else torch decodes)."""
    return _pow2(codes.shape[-1]) and codes.shape[-1] >= 16 and decoded in _KIND and out in _KIND


# ---- centroids + keys -> int8 rows ----------------------------------------------------------------

@triton.jit
def _fp16_scores(cent_ptr, cent_base, c, C, k_ptr, k_base, t, ok, sk_n, DB: tl.constexpr):
    """[C_PAD, BLOCK_N] rows as fp16 values (held in fp32): fp64 sums over the subspace's DB
    dimensions of centroid x key (each product exact in fp64), rounded to fp32, then fp16. One
    rank-1 update per dimension: a [C, N, DB] product tile spilled registers (1.3 ms a layer)."""
    acc = tl.zeros((c.shape[0], t.shape[0]), dtype=tl.float64)
    keys = k_ptr + k_base + t.to(tl.int64) * sk_n
    for j in tl.static_range(DB):
        cent_j = tl.load(cent_ptr + cent_base + c * DB + j, mask=c < C, other=0.0).to(tl.float64)
        key_j = tl.load(keys + j, mask=ok, other=0.0).to(tl.float64)
        acc += cent_j[:, None] * key_j[None, :]
    return acc.to(tl.float32).to(tl.float16).to(tl.float32)


@triton.jit(do_not_specialize=["N", "sk_h"])
def _peak_kernel(cent_ptr, k_ptr, peak_ptr, N, C, M, sc_h, sc_m, sk_h, sk_m, sk_n,
                 C_PAD: tl.constexpr, DB: tl.constexpr, BLOCK_N: tl.constexpr):
    """Each row's largest |fp16 score| over one block of keys, folded in by an atomic max of
    its fp32 bits (non-negative floats order as their bits do)."""
    hm = tl.program_id(0)
    h, m = (hm // M).to(tl.int64), (hm % M).to(tl.int64)
    c = tl.arange(0, C_PAD)
    t = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = _fp16_scores(cent_ptr, h * sc_h + m * sc_m, c, C, k_ptr, h * sk_h + m * sk_m, t, t < N, sk_n, DB)
    peak = tl.max(tl.abs(rows), axis=1)
    tl.atomic_max(peak_ptr + hm * C + c, peak.to(tl.int32, bitcast=True), mask=c < C)


@triton.jit(do_not_specialize=["N", "sk_h", "sr_h", "sr_m", "sr_c"])
def _rows_kernel(cent_ptr, k_ptr, peak_ptr, row_ptr, scale_ptr, N, C, M,
                 sc_h, sc_m, sk_h, sk_m, sk_n, sr_h, sr_m, sr_c,
                 C_PAD: tl.constexpr, DB: tl.constexpr, BLOCK_N: tl.constexpr):
    hm = tl.program_id(0)
    nb = tl.program_id(1)
    h, m = (hm // M).to(tl.int64), (hm % M).to(tl.int64)
    c = tl.arange(0, C_PAD)
    peak = tl.load(peak_ptr + hm * C + c, mask=c < C, other=0).to(tl.float32, bitcast=True)
    scale = tl.div_rn(tl.maximum(peak, 1e-8), 127.0)
    tl.store(scale_ptr + hm * C + c, scale, mask=(c < C) & (nb == 0))
    t = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = t < N
    rows = _fp16_scores(cent_ptr, h * sc_h + m * sc_m, c, C, k_ptr, h * sk_h + m * sk_m, t, ok, sk_n, DB)
    q = tl.div_rn(rows, scale[:, None])
    q = tl.minimum(tl.maximum((q + _RNE) - _RNE, -127.0), 127.0)
    tl.store(row_ptr + h * sr_h + m * sr_m + c[:, None] * sr_c + t.to(tl.int64)[None, :], q.to(tl.int8),
             mask=(c < C)[:, None] & ok[None, :])


def int8_rows(centroids: torch.Tensor, sub_k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows int8 [Hkv, m, C, N], scales fp32 [Hkv, m, C]) of centroids [Hkv, m, C, d_b] fp16 over
    the subspace keys sub_k [Hkv, m, N, d_b] (any strides, each key's slice contiguous): bitwise
    csattention_rows.dense_rows(..., int8=True)."""
    hkv, m, c, db = centroids.shape
    n = sub_k.shape[2]
    cent = centroids.contiguous()
    rows = torch.empty(hkv, m, c, n, dtype=torch.int8, device=sub_k.device)
    scales = torch.empty(hkv, m, c, dtype=torch.float32, device=sub_k.device)
    peaks = torch.zeros(hkv, m, c, dtype=torch.int32, device=sub_k.device)
    block = 128
    grid = (hkv * m, triton.cdiv(n, block))
    shape = dict(C_PAD=triton.next_power_of_2(c), DB=db, BLOCK_N=block, num_warps=4)
    keys = (sub_k.stride(0), sub_k.stride(1), sub_k.stride(2))
    _peak_kernel[grid](cent, sub_k, peaks, n, c, m, cent.stride(0), cent.stride(1), *keys, **shape)
    _rows_kernel[grid](cent, sub_k, peaks, rows, scales, n, c, m, cent.stride(0), cent.stride(1), *keys,
                       rows.stride(0), rows.stride(1), rows.stride(2), **shape)
    return rows, scales


def rows_ok(centroids: torch.Tensor, sub_k: torch.Tensor) -> bool:
    """The kernel takes these (a power-of-two subspace width, each key's slice contiguous)."""
    return _pow2(centroids.shape[-1]) and sub_k.stride(-1) == 1 and centroids.dtype == torch.float16
