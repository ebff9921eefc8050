"""CSAttention selection scores for the dense full-list layout, fused with the first radix pass.

Layout (CSAttention.build with list_fraction=1.0): dense_score [B, Hkv, m, C, N] holds every
key's score against every centroid of each subspace, in key order. For query head g of KV
head h routed to centroid c_gj in subspace j with weight w_gj (||q_j|| for qnorm), the
group-summed estimate (group_combine="sum") is

    score[b, h, n] = sum_{g, j} w_gj * dense_score[b, h, j, c_gj, n]        (n < n_ctx[b])
                   + sum_{g, j} w_gj * new_scores[b, h, j, c_gj, n - start]  (streamed keys)

i.e. a weighted sum of G * m gathered rows; streamed keys count unconditionally (every key is
in every full list: CSAttention._add_streamed with floor = -inf and offset 0).

One program per (row, KV head, block of keys) loads R_CHUNK of the G * m rows per 2-D load, so
many independent loads are in flight (the step is a pure HBM read: 32 rows x N x 2 bytes per
KV head at Llama-3.1-8B shapes). Query heads of a group that routed to the same centroid are
not merged: the repeated row is served from L1/L2 within the same program.

The same program writes the fp32 scores and adds its block's histogram of the top 8 radix
bits inside [lo, hi) to the Top-K workspace (by shared-memory atomics where compiled), so the
radix select (topk.radix_topk with hist0_done=True) starts at pass 1: one launch and one read
of the scores saved. With a uint16
output it writes 16-bit order-preserving keys of the fp16-rounded scores instead, so the
select needs one more histogram pass and the collect (two launches instead of four).

Optional int8 storage: dense_score int8 with a per-(row, head, subspace, centroid) scale
[B, Hkv, m, C] fp32 (absmax / 127); the scale folds into the row's weight, so the kernel reads
half the bytes for the same arithmetic. (The selector scores int8 tables with 16-bit keys by
integer dot products instead, kernels/dense_dot8: CSAttention's reference arithmetic.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ctxcache.kernels.smem_hist import smem_hist_add
from ctxcache.kernels.sync import compiled, launch_opts, pdl_enter
from ctxcache.kernels.topk import _keys, _keys16, _row_bounds


def dense_scores_ref(ids: torch.Tensor, w: torch.Tensor, dense: torch.Tensor, scale: torch.Tensor | None,
                     new_scores: torch.Tensor, n_ctx: torch.Tensor, start: torch.Tensor,
                     count: torch.Tensor, n_max: int) -> torch.Tensor:
    """Torch reference (CSAttention.estimate, dense branch, summed over the group).

    ids, w [B, Hq, m]; dense [B, Hkv, m, C, N] (fp16, or int8 with scale [B, Hkv, m, C]);
    new_scores [B, Hkv, m, C, T] fp32; n_ctx, start, count [B] -> scores [B, Hkv, n_max] fp32."""
    b, hq, m = ids.shape
    hkv = dense.shape[1]
    g = hq // hkv
    ids4 = ids.view(b, hkv, g, m).long()
    bb = torch.arange(b, device=ids.device)[:, None, None, None]
    hh = torch.arange(hkv, device=ids.device)[None, :, None, None]
    mm = torch.arange(m, device=ids.device)[None, None, None, :]
    w4 = w.view(b, hkv, g, m).float()
    ws = w4 * scale[bb, hh, mm, ids4] if scale is not None else w4
    rows = dense[bb, hh, mm, ids4].float()  # [B, Hkv, G, m, N]
    out = torch.zeros(b, hkv, n_max, device=ids.device)
    for r in range(b):
        nc, s0, cnt = int(n_ctx[r]), int(start[r]), int(count[r])
        out[r, :, :nc] = torch.einsum("hgmn,hgm->hn", rows[r, ..., :nc], ws[r])
        if cnt:
            new = new_scores[r][hh[0], mm[0], ids4[r]][..., :cnt]  # [Hkv, G, m, cnt]
            out[r, :, s0:s0 + cnt] += torch.einsum("hgmt,hgm->ht", new.float(), w4[r])
    return out


@triton.jit
def _routed_chunk(ids_ptr, w_ptr, b, h, G, M, si_b, si_h, r0, R_CHUNK: tl.constexpr):
    """Rows r0 .. r0 + R_CHUNK of the flattened (query head of the group, subspace) pairs: (in
    range, subspace, routed centroid, weight)."""
    gm = r0 + tl.arange(0, R_CHUNK)
    ok = gm < G * M
    j = gm % M
    qoff = b * si_b + (h * G + gm // M) * si_h + j
    return ok, j, tl.load(ids_ptr + qoff, mask=ok, other=0), tl.load(w_ptr + qoff, mask=ok, other=0.0)


@triton.jit
def score_program(nctx_ptr, start_ptr, cnt_ptr, lo_ptr, hi_ptr, k_ptr, HKV: tl.constexpr):
    """A score program's (row, key block, batch row, KV head) and its row's lengths: keys in the
    table, streamed keys' start and count, the Top-K region [lo, hi) and k. All loaded up front:
    after the key store, these loads would wait behind it."""
    row, lo, hi, k = _row_bounds(lo_ptr, hi_ptr, k_ptr, HKV)
    b = row // HKV
    return (row, tl.program_id(1), b, row % HKV, tl.load(nctx_ptr + b), tl.load(start_ptr + b),
            tl.load(cnt_ptr + b), lo, hi, k)


@triton.jit
def _dense_score_kernel(ids_ptr, w_ptr, ds_ptr, scale_ptr, ns_ptr, nctx_ptr, start_ptr, cnt_ptr,
                        lo_ptr, hi_ptr, k_ptr, acc_ptr, ws_ptr,
                        si_b, si_h, sd_b, sd_h, sd_m, sd_c, ss_b, ss_h, ss_m,
                        sn_b, sn_h, sn_m, sn_c, sa_b, sa_h, sws_r,
                        HKV: tl.constexpr, G: tl.constexpr, M: tl.constexpr,  # constexpr: the row / head
                        # index arithmetic becomes shifts (sm_90 build: 1840 -> 1424 instructions)
                        GM_PAD: tl.constexpr, R_CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                        SCALED: tl.constexpr, KEY16: tl.constexpr, HIST0: tl.constexpr, ALIGN16: tl.constexpr,
                        USE_PDL: tl.constexpr, ROW_EVICT: tl.constexpr, SMEM: tl.constexpr):
    pdl_enter(USE_PDL)
    row, blk, b, h, nctx, s0, cnt, lo, hi, k = score_program(nctx_ptr, start_ptr, cnt_ptr, lo_ptr, hi_ptr, k_ptr, HKV)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    in_ctx = offs < nctx
    # a load mask whose runs of 16 keys are provably whole lets Triton issue 16-byte vector
    # loads (an exact mask at an unknown length gives one scalar load per key)
    in_load = offs < (nctx + 15) // 16 * 16 if ALIGN16 else in_ctx
    t = offs - s0
    in_new = (t >= 0) & (t < cnt)
    has_new = (cnt > 0) & (s0 < blk * BLOCK + BLOCK) & (s0 + cnt > blk * BLOCK)  # block holds streamed keys
    acc = tl.zeros((BLOCK,), tl.float32)
    for r0 in tl.static_range(0, GM_PAD, R_CHUNK):
        ok, j, c, w = _routed_chunk(ids_ptr, w_ptr, b, h, G, M, si_b, si_h, r0, R_CHUNK)
        wq = w
        if SCALED:
            wq = w * tl.load(scale_ptr + b * ss_b + h * ss_h + j * ss_m + c, mask=ok, other=0.0)
        # int64: a batch of 128K-token tables exceeds 2^31 elements
        base = b.to(tl.int64) * sd_b + h.to(tl.int64) * sd_h + j * sd_m + c.to(tl.int64) * sd_c
        x = tl.load(ds_ptr + base[:, None] + offs[None, :], mask=ok[:, None] & in_load[None, :], other=0,
                    eviction_policy=ROW_EVICT)
        # keys read past the context by the rounded-up mask count as zero
        acc += tl.sum(tl.where(in_ctx[None, :], x.to(tl.float32), 0.0) * wq[:, None], axis=0)
        if has_new:
            nbase = b * sn_b + h * sn_h + j * sn_m + c * sn_c
            y = tl.load(ns_ptr + nbase[:, None] + t[None, :], mask=ok[:, None] & in_new[None, :], other=0.0)
            acc += tl.sum(y * w[:, None], axis=0)
    if KEY16:
        store_keys16(acc, offs, acc_ptr + b * sa_b + h * sa_h, ws_ptr + row * sws_r, lo, hi, k, HIST0, SMEM)
    else:
        tl.store(acc_ptr + b * sa_b + h * sa_h + offs, acc)
        if HIST0:
            _add_hist0((_keys(acc) >> 24).to(tl.int32), offs, ws_ptr + row * sws_r, lo, hi, k, SMEM)


@triton.jit
def _add_hist0(digit, offs, hist_ptr, lo, hi, k, SMEM: tl.constexpr):
    """Radix pass 0 (the key's top 8 bits) over this block's share of [lo, hi), added to the row's
    histogram: by shared-memory atomics where compiled (SMEM), else tl.histogram."""
    valid = (offs >= lo) & (offs < hi) & (k > 0)
    if SMEM:
        smem_hist_add(digit, valid, hist_ptr, offs.shape[0])
    else:
        hist = tl.histogram(digit, 256, mask=valid)
        # a block's keys fill few of the 256 bins: skipping empty ones saves most global atomics
        tl.atomic_add(hist_ptr + tl.arange(0, 256), hist, mask=hist > 0, sem="relaxed")


@triton.jit
def store_keys16(acc, offs, key_row_ptr, hist_ptr, lo, hi, k, HIST0: tl.constexpr, SMEM: tl.constexpr):
    """Store the 16-bit keys of a block's fp32 scores at key_row_ptr + offs; with HIST0, add
    their radix pass 0 to the row's histogram at hist_ptr."""
    key = _keys16(acc)
    tl.store(key_row_ptr + offs, key)
    if HIST0:
        _add_hist0((key >> 8).to(tl.int32), offs, hist_ptr, lo, hi, k, SMEM)


def check_routed_inputs(ids: torch.Tensor, w: torch.Tensor, dense: torch.Tensor, new_scores: torch.Tensor,
                        **lengths: torch.Tensor) -> None:
    """The score kernels' shared checks: routed ids (int32) / w [B, R, m] against dense
    [B, Hkv, m, C, N] (contiguous in N; R a multiple of Hkv), new_scores fp32 [B, Hkv, m, C, T],
    and the per-row lengths int32 [B]."""
    b, hr, m = ids.shape
    bd, hkv, m2, c, _ = dense.shape
    if m2 != m or hr % hkv or bd != b or dense.stride(4) != 1:
        raise ValueError(f"ids {tuple(ids.shape)} and dense {tuple(dense.shape)} disagree (dense contiguous in N)")
    if not (ids.is_contiguous() and w.is_contiguous() and ids.dtype == torch.int32):
        raise ValueError("ids (int32) and w must be contiguous")
    if new_scores.shape[:4] != (b, hkv, m, c) or new_scores.stride(4) != 1 or new_scores.dtype != torch.float32:
        raise ValueError(f"new_scores {tuple(new_scores.shape)} must be fp32 [{b}, {hkv}, {m}, {c}, T]")
    for name, t in lengths.items():
        if t.shape != (b,) or t.dtype != torch.int32:
            raise ValueError(f"{name} {tuple(t.shape)} {t.dtype} must be int32 [{b}]")


def dense_scores(ids: torch.Tensor, w: torch.Tensor, dense: torch.Tensor, scale: torch.Tensor | None,
                 new_scores: torch.Tensor, n_ctx: torch.Tensor, start: torch.Tensor, count: torch.Tensor,
                 lo: torch.Tensor, hi: torch.Tensor, k: torch.Tensor, acc: torch.Tensor, ws: torch.Tensor,
                 block: int = 1024, r_chunk: int = 8, num_warps: int = 4, hist0: bool = True,
                 maxnreg: int | None = None, pdl: bool = False, evict_first: bool = True,
                 smem_hist: bool | None = None) -> torch.Tensor:
    """Write scores into acc [B, Hkv, N_max] fp32 (N_max a multiple of `block`), or their 16-bit
    keys (topk.keys16_ref) if acc is uint16, and add radix pass 0 into ws (topk.workspace,
    zeroed by the caller; hist0=False skips it). ids/w [B, Hq, m] per query head, or [B, Hkv, m]
    for group routing. maxnreg caps registers per thread (compiled GPU code only). evict_first:
    the table rows, read once, leave L2 first, so the keys written here are still there for the
    radix passes that read them next (H100, 128K batch 8: selection 104.9 -> 98.7 us, but the
    whole step only ~1 us faster: the keys' write-back to DRAM then falls in the attention).
    smem_hist: pass 0 by shared-memory atomics (kernels/smem_hist) rather than tl.histogram;
    None: where compiled. Shapes as in dense_scores_ref."""
    check_routed_inputs(ids, w, dense, new_scores, n_ctx=n_ctx, start=start, count=count, lo=lo, hi=hi, k=k)
    b, hq, m = ids.shape
    hkv, n = dense.shape[1], dense.shape[4]
    if dense.dtype not in (torch.float16, torch.int8):
        raise ValueError(f"dense {dense.dtype} must be fp16 or int8")
    if (scale is not None) != (dense.dtype == torch.int8):
        raise ValueError("int8 dense_score needs its scale; fp16 takes none")
    if scale is not None and (scale.shape != dense.shape[:4] or scale.stride(3) != 1 or scale.dtype != torch.float32):
        raise ValueError(f"scale {tuple(scale.shape)} must be fp32 {tuple(dense.shape[:4])}, contiguous in C")
    n_max = acc.shape[2]
    if acc.dtype not in (torch.float32, torch.uint16) or acc.shape[:2] != (b, hkv) or acc.stride(2) != 1:
        raise ValueError(f"acc {tuple(acc.shape)} {acc.dtype} must be fp32 or uint16 [{b}, {hkv}, N_max]")
    # A warp loads 16 bytes per thread along N (8 fp16 or 16 int8 values): a block narrower than
    # the warps' span puts rows on different warps and every chunk then pays a cross-warp
    # reduction through shared memory (measured on the H100: int8 at block 1024 ran 3x slower
    # than fp16), so widen the block to the span where N_max allows (speed only, not results).
    span = (16 // dense.element_size()) * 32 * num_warps
    if block < span and n_max % span == 0:
        block = span
    if n_max % block:
        raise ValueError(f"acc N_max={n_max} must be a multiple of the block {block}")
    sd, sn = dense.stride(), new_scores.stride()
    ss = scale.stride()[:3] if scale is not None else (0, 0, 0)
    gm_pad = max(r_chunk, triton.next_power_of_2((hq // hkv) * m))
    _dense_score_kernel[(b * hkv, n_max // block)](
        ids, w, dense, scale if scale is not None else w, new_scores, n_ctx, start, count, lo, hi, k, acc, ws,
        ids.stride(0), ids.stride(1), sd[0], sd[1], sd[2], sd[3], *ss,
        sn[0], sn[1], sn[2], sn[3], acc.stride(0), acc.stride(1), ws.stride(0),
        HKV=hkv, G=hq // hkv, M=m, GM_PAD=gm_pad, R_CHUNK=min(r_chunk, gm_pad), BLOCK=block, SCALED=scale is not None,
        KEY16=acc.dtype == torch.uint16, HIST0=hist0, ALIGN16=n % 16 == 0 and all(x % 16 == 0 for x in sd[:4]),
        num_warps=num_warps, USE_PDL=pdl, ROW_EVICT="evict_first" if evict_first else "",
        SMEM=compiled(acc) if smem_hist is None else smem_hist, **launch_opts(pdl),
        **({"maxnreg": maxnreg} if maxnreg else {}))  # a register cap buys occupancy (ncu: 126 regs, 25%)
    return acc
