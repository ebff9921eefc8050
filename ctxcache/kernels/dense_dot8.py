"""Selection scores from int8 dense tables by integer dot products (dp4a), fused with radix pass 0.

Why: at 128K and batch 8 the fp16 score kernel streams 128 MB of routed table rows at the
stream floor of the H100 (bench/kv_layout_probe.py at d74d176), so only fewer bytes make it faster. int8
tables halve the bytes, but converting each int8 value to fp32 and multiplying it by a fp32
weight costs more instructions than the bytes save (the fp32-weight int8 path in
dense_select). Here the routed weights are quantized to int8 too, and each group of 4 routed
rows is reduced per key by one `dp4a` (4 byte products summed into an int32): about 6
instructions per key for 8 rows instead of about 24.

Arithmetic (methods/int8_tables, shared with the CPU method; dense_dot8_ref applies it). For
row set (b, h) with routed rows r (weight w_r, table row scale s_r of quantize_rows),
ws_r = w_r * s_r in fp32. The weights get
a power-of-two scale 2^e with max_r |ws_r| * 2^-e in [64, 128), so quantizing is exact
arithmetic: wq_r = clamp(floor(ws_r * 2^-e + 0.5), -127, 127). Then

    score[n] = 2^e * sum_r wq_r * dense_q[r, n]     (int32 sum, exact; the product is exact)
             + sum_r w_r * new_scores[r, n - start]  (streamed keys, fp32, as dense_select)

so the context keys' scores are bitwise what the reference computes, on the GPU and under the
interpreter. The weights lose at most 1/128 of the largest weight (the tables' own int8 step
is 1/254 of a row's range). Output: 16-bit keys of the fp16-rounded scores (topk.keys16_ref)
and radix pass 0 into the Top-K workspace, as dense_select.dense_scores with uint16 output.

The GPU build issues `prmt` (a 4x4 byte transpose of 4 rows x 4 keys) and `dp4a` through
inline PTX; the CPU interpreter, which cannot run PTX, computes the same int32 sums with shifts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ctxcache.kernels.dense_select import _routed_chunk, check_routed_inputs, score_program, store_keys16
from ctxcache.kernels.sync import compiled, launch_opts, pdl_enter
from ctxcache.methods.int8_tables import int_dot_scores

_DOT4_PTX = tl.constexpr("""{
.reg .b32 u0, u1, t0, t1, t2, t3;
prmt.b32 u0, $8, $9, 0x5140;
prmt.b32 u1, $10, $11, 0x5140;
prmt.b32 t0, u0, u1, 0x5410;
prmt.b32 t1, u0, u1, 0x7632;
prmt.b32 u0, $8, $9, 0x7362;
prmt.b32 u1, $10, $11, 0x7362;
prmt.b32 t2, u0, u1, 0x5410;
prmt.b32 t3, u0, u1, 0x7632;
dp4a.s32.s32 $0, t0, $12, $4;
dp4a.s32.s32 $1, t1, $12, $5;
dp4a.s32.s32 $2, t2, $12, $6;
dp4a.s32.s32 $3, t3, $12, $7;
}""")


def dense_dot8_ref(ids: torch.Tensor, w: torch.Tensor, dense: torch.Tensor, scale: torch.Tensor,
                   new_scores: torch.Tensor, n_ctx: torch.Tensor, start: torch.Tensor, count: torch.Tensor,
                   n_max: int) -> torch.Tensor:
    """Torch reference: fp32 scores [B, Hkv, n_max] (before the fp16 key rounding). ids, w
    [B, R_h, m] with R_h = Hkv (group routing) or Hq; dense int8 [B, Hkv, m, C, N] with scale
    [B, Hkv, m, C]; the rest as dense_select.dense_scores_ref."""
    b, hr, m = ids.shape
    hkv = dense.shape[1]
    g = hr // hkv
    ids4 = ids.view(b, hkv, g * m).long()
    bb = torch.arange(b, device=ids.device)[:, None, None]
    hh = torch.arange(hkv, device=ids.device)[None, :, None]
    jj = (torch.arange(g * m, device=ids.device) % m)[None, None, :]
    w3 = w.view(b, hkv, g * m).float()
    isum = int_dot_scores(dense[bb, hh, jj, ids4], w3 * scale[bb, hh, jj, ids4])  # [B, Hkv, N]
    out = torch.zeros(b, hkv, n_max, device=ids.device)
    for r in range(b):
        nc, s0, cnt = int(n_ctx[r]), int(start[r]), int(count[r])
        out[r, :, :nc] = isum[r, :, :nc]
        if cnt:
            new = new_scores[r][hh[0], jj[0], ids4[r]][..., :cnt]  # [Hkv, R, cnt]
            out[r, :, s0:s0 + cnt] += torch.einsum("hrt,hr->ht", new.float(), w3[r])
    return out


@triton.jit
def _byte(x, J: tl.constexpr):
    """Signed byte J of int32 words."""
    return (x << (24 - 8 * J)) >> 24


@triton.jit
def _dot4(a0, a1, a2, a3, x0, x1, x2, x3, wpack, ASM: tl.constexpr):
    """a_j += sum_i byte_j(x_i) * byte_i(wpack): keys 4q + j of 4 rows (words x_i) against
    their 4 int8 weights."""
    if ASM:
        a0, a1, a2, a3 = tl.inline_asm_elementwise(
            _DOT4_PTX, "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r", [a0, a1, a2, a3, x0, x1, x2, x3, wpack],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
    else:
        w0, w1, w2, w3 = _byte(wpack, 0), _byte(wpack, 1), _byte(wpack, 2), _byte(wpack, 3)
        a0 += _byte(x0, 0) * w0 + _byte(x1, 0) * w1 + _byte(x2, 0) * w2 + _byte(x3, 0) * w3
        a1 += _byte(x0, 1) * w0 + _byte(x1, 1) * w1 + _byte(x2, 1) * w2 + _byte(x3, 1) * w3
        a2 += _byte(x0, 2) * w0 + _byte(x1, 2) * w1 + _byte(x2, 2) * w2 + _byte(x3, 2) * w3
        a3 += _byte(x0, 3) * w0 + _byte(x1, 3) * w1 + _byte(x2, 3) * w2 + _byte(x3, 3) * w3
    return a0, a1, a2, a3


@triton.jit
def _routed_row(ids_ptr, w_ptr, scale_ptr, b, h, R: tl.constexpr, G: tl.constexpr, M: tl.constexpr,
                si_b, si_h, ss_b, ss_h, ss_m):
    """Routed row R (scalar): (centroid, fp32 weight, weight x table row scale)."""
    qoff = b * si_b + (h * G + R // M) * si_h + R % M
    c = tl.load(ids_ptr + qoff)
    w = tl.load(w_ptr + qoff)
    return c, w, w * tl.load(scale_ptr + b * ss_b + h * ss_h + (R % M) * ss_m + c)


@triton.jit
def _row_words(ds_ptr, c, b, h, R: tl.constexpr, M: tl.constexpr, sd_b, sd_h, sd_m, sd_c, words, in_load,
               ROW_EVICT: tl.constexpr):
    """Row R's int32 words (4 int8 keys each) of this block."""
    base = b.to(tl.int64) * sd_b + h.to(tl.int64) * sd_h + (R % M) * sd_m + c.to(tl.int64) * sd_c
    return tl.load(ds_ptr + base + words, mask=in_load, other=0, eviction_policy=ROW_EVICT)


@triton.jit
def _dense_dot8_kernel(ids_ptr, w_ptr, ds_ptr, scale_ptr, ns_ptr, nctx_ptr, start_ptr, cnt_ptr,
                       lo_ptr, hi_ptr, k_ptr, key_ptr, ws_ptr,
                       si_b, si_h, sd_b, sd_h, sd_m, sd_c, ss_b, ss_h, ss_m,
                       sn_b, sn_h, sn_m, sn_c, sa_b, sa_h, sws_r,
                       HKV: tl.constexpr, G: tl.constexpr, M: tl.constexpr, GM_PAD: tl.constexpr,
                       R_CHUNK: tl.constexpr, BLOCK: tl.constexpr, HIST0: tl.constexpr, ASM: tl.constexpr,
                       SMEM: tl.constexpr, USE_PDL: tl.constexpr, ROW_EVICT: tl.constexpr,
                       PRE_WAIT: tl.constexpr = True):
    if not PRE_WAIT:
        pdl_enter(USE_PDL)
    row, blk, b, h, nctx, s0, cnt, lo, hi, k = score_program(nctx_ptr, start_ptr, cnt_ptr, lo_ptr, hi_ptr, k_ptr, HKV)
    if PRE_WAIT:  # the lengths come from before the step's first launch (sync.py); ids need the route
        pdl_enter(USE_PDL)
    if k == 0:  # nothing to select (a row carrying its last selection: reselect): no row is read
        return
    QW: tl.constexpr = BLOCK // 4
    words = blk * QW + tl.arange(0, QW)
    in_load = words < (nctx + 15) // 16 * 4  # whole 16-key runs: 16-byte vector loads

    # the weights' power-of-two scale from the largest |w_r * s_r| (exponent bits, as the reference)
    big = tl.zeros((), tl.float32)
    for r in tl.static_range(G * M):
        _, _, ws = _routed_row(ids_ptr, w_ptr, scale_ptr, b, h, r, G, M, si_b, si_h, ss_b, ss_h, ss_m)
        big = tl.maximum(big, tl.abs(ws))
    e_bits = (big.to(tl.int32, bitcast=True) >> 23) & 0xFF
    ok = e_bits >= 7
    inv = tl.where(ok, (260 - e_bits) << 23, 0).to(tl.float32, bitcast=True)
    deq = tl.where(ok, (e_bits - 6) << 23, 0).to(tl.float32, bitcast=True)

    a0 = tl.zeros((QW,), tl.int32)
    a1 = tl.zeros((QW,), tl.int32)
    a2 = tl.zeros((QW,), tl.int32)
    a3 = tl.zeros((QW,), tl.int32)
    for r4 in tl.static_range(0, G * M, 4):  # 4 routed rows per dp4a (absent rows: weight 0)
        wpack = tl.zeros((), tl.int32)
        x0 = tl.zeros((QW,), tl.int32)
        x1 = tl.zeros((QW,), tl.int32)
        x2 = tl.zeros((QW,), tl.int32)
        x3 = tl.zeros((QW,), tl.int32)
        for i in tl.static_range(4):
            if r4 + i < G * M:
                c, w, ws = _routed_row(ids_ptr, w_ptr, scale_ptr, b, h, r4 + i, G, M, si_b, si_h, ss_b, ss_h, ss_m)
                wq = tl.minimum(tl.maximum(tl.floor(ws * inv + 0.5), -127.0), 127.0).to(tl.int32)
                wpack = wpack | ((wq & 0xFF) << (8 * i))
                x = _row_words(ds_ptr, c, b, h, r4 + i, M, sd_b, sd_h, sd_m, sd_c, words, in_load, ROW_EVICT)
                if i == 0:
                    x0 = x
                elif i == 1:
                    x1 = x
                elif i == 2:
                    x2 = x
                else:
                    x3 = x
        a0, a1, a2, a3 = _dot4(a0, a1, a2, a3, x0, x1, x2, x3, wpack + tl.zeros((QW,), tl.int32), ASM)

    # keys 4q + j: interleave the four sums into block order
    isum = tl.reshape(tl.join(tl.join(a0, a2), tl.join(a1, a3)), (BLOCK,))
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    acc = tl.where(offs < nctx, isum.to(tl.float32) * deq, 0.0)
    t = offs - s0
    if (cnt > 0) & (s0 < blk * BLOCK + BLOCK) & (s0 + cnt > blk * BLOCK):  # block holds streamed keys
        in_new = (t >= 0) & (t < cnt)
        for r0 in tl.static_range(0, GM_PAD, R_CHUNK):
            okr, jr, cr, wr = _routed_chunk(ids_ptr, w_ptr, b, h, G, M, si_b, si_h, r0, R_CHUNK)
            nbase = b * sn_b + h * sn_h + jr * sn_m + cr * sn_c
            y = tl.load(ns_ptr + nbase[:, None] + t[None, :], mask=okr[:, None] & in_new[None, :], other=0.0)
            acc += tl.sum(y * wr[:, None], axis=0)
    store_keys16(acc, offs, key_ptr + b * sa_b + h * sa_h, ws_ptr + row * sws_r, lo, hi, k, HIST0, SMEM)


def dense_dot8(ids: torch.Tensor, w: torch.Tensor, dense: torch.Tensor, scale: torch.Tensor,
               new_scores: torch.Tensor, n_ctx: torch.Tensor, start: torch.Tensor, count: torch.Tensor,
               lo: torch.Tensor, hi: torch.Tensor, k: torch.Tensor, keys: torch.Tensor, ws: torch.Tensor,
               block: int = 1024, num_warps: int = 4, hist0: bool = True, maxnreg: int | None = None,
               pdl: bool = False, evict_first: bool = True, asm: bool | None = None,
               smem_hist: bool | None = None, pre_wait: bool = True) -> torch.Tensor:
    """Write 16-bit keys of dense_dot8_ref's scores into keys [B, Hkv, N_max] uint16 (N_max a
    multiple of `block`) and add radix pass 0 into ws (as dense_select.dense_scores). dense:
    int8 [B, Hkv, m, C, N] with N a multiple of 16 and its scale [B, Hkv, m, C] fp32. asm: the
    dp4a PTX, smem_hist: pass 0 by shared-memory atomics (kernels/smem_hist); None: where compiled.
    pre_wait: with pdl, load the row lengths (n_ctx, start, count, lo, hi, k) before waiting for
    the route (they must come from before the step's first launch, see sync.py)."""
    check_routed_inputs(ids, w, dense, new_scores, n_ctx=n_ctx, start=start, count=count, lo=lo, hi=hi, k=k)
    b, hr, m = ids.shape
    hkv, n = dense.shape[1], dense.shape[4]
    if dense.dtype != torch.int8 or scale is None or scale.dtype != torch.float32 or scale.shape != dense.shape[:4]:
        raise ValueError(f"dense {dense.dtype} must be int8 with an fp32 scale {tuple(dense.shape[:4])}")
    if scale.stride(3) != 1:
        raise ValueError("scale must be contiguous in C")
    if n % 16 or any(s % 16 for s in dense.stride()[:4]):
        raise ValueError(f"dense rows must hold whole 16-key runs (N={n}, strides {dense.stride()})")
    if keys.dtype != torch.uint16 or keys.shape[:2] != (b, hkv) or keys.stride(2) != 1 or keys.shape[2] % block:
        raise ValueError(f"keys {tuple(keys.shape)} {keys.dtype} must be uint16 [{b}, {hkv}, k x {block}]")
    if block < 64 or block & (block - 1):
        raise ValueError(f"block={block} must be a power of two >= 64")
    g = hr // hkv
    gm_pad = triton.next_power_of_2(g * m)
    words = dense.view(torch.int32)  # 4 keys per word (N and the strides are multiples of 16)
    sd = [s // 4 for s in dense.stride()[:4]]
    sn = new_scores.stride()
    on_gpu = compiled(keys)  # inline PTX only in compiled GPU code
    _dense_dot8_kernel[(b * hkv, keys.shape[2] // block)](
        ids, w, words, scale, new_scores, n_ctx, start, count, lo, hi, k, keys, ws,
        ids.stride(0), ids.stride(1), *sd, *scale.stride()[:3], sn[0], sn[1], sn[2], sn[3],
        keys.stride(0), keys.stride(1), ws.stride(0),
        HKV=hkv, G=g, M=m, GM_PAD=gm_pad, R_CHUNK=1, BLOCK=block, HIST0=hist0, ASM=on_gpu if asm is None else asm,
        SMEM=on_gpu if smem_hist is None else smem_hist,
        USE_PDL=pdl, ROW_EVICT="evict_first" if evict_first else "", PRE_WAIT=pre_wait, num_warps=num_warps,
        **launch_opts(pdl),
        **({"maxnreg": maxnreg} if maxnreg else {}))
    return keys
