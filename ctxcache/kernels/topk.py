"""Top-K by radix select over a dense score row (replaces torch.topk: 115 us at 128K).

Histogram passes of 8 bits over order-preserving keys find the K-th largest key T; a collect
pass writes every index with key > T and as many ties == T as K needs. Rows are fp32 scores
(32-bit keys, four passes, ties in atomic order) or 16-bit keys that a producer already wrote
(`keys16`: the order-preserving code of the score rounded to fp16): two passes, and ties go
to the lowest indices, deterministically, as CSAttention.search ranks. Pass 1 then counts
only the keys in the K-th key's pass-0 bin (element atomics, no full-block histogram) into its
block's histogram, then adds that to the row's, so the collect knows how many ties lie in the
blocks before it. Rows hold fewer than MAX_ROW keys.
Each pass is one launch over (row, chunk) programs (the 16-bit passes' chunks sit at multiples
of the block, from key 0, for vector loads); histograms merge by global atomics and
every program re-derives the prefix from the finished histograms (no host round trip, so the
whole select is graph-capturable). Output order is unspecified (like topk(sorted=False)).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ctxcache.kernels.sync import launch_opts, pdl_enter
from ctxcache.methods.budget import fp16_keys

_BINS = 256
_PASSES = 4
_HEAD = _PASSES * _BINS + 2  # per-row workspace: 4 histograms + 2 counters, then block histograms
MAX_ROW = 1 << 22  # keys per row: the walk packs a count of bins and a count of keys in 32 bits
_WALK0 = tl.constexpr(2 * _BINS)  # 16-bit keys: pass 0's walk (prefix, krem) where pass 2's histogram would be


def topk_ref(scores: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, k: torch.Tensor) -> list[torch.Tensor]:
    """Per row r of scores [R, N]: indices of the k[r] largest in [lo[r], hi[r]) (any order)."""
    return [torch.topk(scores[r, int(lo[r]):int(hi[r])], int(k[r])).indices + int(lo[r])
            for r in range(scores.shape[0])]


@triton.jit
def _keys(x):
    """Order-preserving uint32 keys of fp32 values (+0 and -0 share a key)."""
    bits = (x + 0.0).to(tl.uint32, bitcast=True)
    return tl.where((bits >> 31) == 1, bits ^ 0xFFFFFFFF, bits | 0x80000000)


@triton.jit
def _keys16(x):
    """Order-preserving uint16 keys of fp32 values rounded to fp16 (+0 and -0 share a key)."""
    bits = (x + 0.0).to(tl.float16).to(tl.uint16, bitcast=True)
    return tl.where((bits >> 15) == 1, bits ^ 0xFFFF, bits | 0x8000)


keys16_ref = fp16_keys  # torch reference of _keys16, int32 in [0, 65536)


def key16_codes(keys: torch.Tensor) -> torch.Tensor:
    """Stored uint16 keys as int32 codes in [0, 65536) (keys16_ref's values); torch has few uint16
    ops, so through int16: reinterpret, widen, mask."""
    return keys.view(torch.int16).int() & 0xFFFF


@triton.jit
def _walk(hist_ptr, k, P: tl.constexpr, TOP: tl.constexpr):
    """Prefix of the K-th largest key after P finished passes, and how many of that prefix are
    still needed. TOP: shift of the first digit (24 for 32-bit keys, 8 for 16-bit keys)."""
    return _walk_from(hist_ptr, tl.zeros((), dtype=tl.uint32), k, 0, P, TOP)


@triton.jit
def _walk_from(hist_ptr, prefix, krem, Q0: tl.constexpr, P: tl.constexpr, TOP: tl.constexpr):
    """_walk resumed after pass Q0 - 1 from its (prefix, krem)."""
    bins = tl.arange(0, 256)
    for q in tl.static_range(Q0, P):
        hst = tl.load(hist_ptr + q * 256 + bins)
        ge = tl.cumsum(hst, axis=0, reverse=True)  # count with digit >= d: non-increasing in d
        hit = ge >= krem
        # the bins with ge >= krem are 0..d, so they number d + 1; the count above digit d,
        # ge[d + 1], is the sum of the other bins. Both in one reduction (counts < 2^22 per row,
        # radix_topk checks): one cross-warp reduction less than two maxima.
        both = tl.sum(hit.to(tl.int32) + (tl.where(hit, 0, hst) << 9), axis=0)
        d = (both & 511) - 1
        krem = krem - (both >> 9)
        prefix = prefix | (d.to(tl.uint32) << (TOP - 8 * q))
    return prefix, krem


@triton.jit
def _row_bounds(lo_ptr, hi_ptr, k_ptr, HKV):
    """This program's row (batch element x KV head) and its batch element's lo, hi and k (the
    kernels take HKV as a constexpr: the division is then a shift ahead of the first loads)."""
    r = tl.program_id(0)
    b = r // HKV
    return r, tl.load(lo_ptr + b), tl.load(hi_ptr + b), tl.load(k_ptr + b)


@triton.jit
def _block_keys(x_ptr, lo_ptr, hi_ptr, k_ptr, ws_ptr, HKV, sx_r, sws_r, BLOCK: tl.constexpr,
                KEY16: tl.constexpr):
    """This program's block of one row: (radix keys, valid mask, offsets, k, row workspace)."""
    r, lo, hi, k = _row_bounds(lo_ptr, hi_ptr, k_ptr, HKV)
    offs = lo + tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = (offs < hi) & (k > 0)
    if KEY16:  # the producer stored keys already
        key = tl.load(x_ptr + r * sx_r + offs, mask=valid, other=0).to(tl.uint32)
    else:
        key = _keys(tl.load(x_ptr + r * sx_r + offs, mask=valid, other=0.0))
    return key, valid, offs, k, ws_ptr + r * sws_r


@triton.jit
def _hist_kernel(x_ptr, lo_ptr, hi_ptr, k_ptr, ws_ptr, HKV: tl.constexpr, sx_r, sws_r,
                 P: tl.constexpr, BLOCK: tl.constexpr, KEY16: tl.constexpr, TOP: tl.constexpr):
    key, valid, offs, k, hist_ptr = _block_keys(x_ptr, lo_ptr, hi_ptr, k_ptr, ws_ptr, HKV, sx_r, sws_r,
                                                BLOCK, KEY16)
    if P > 0:
        prefix, krem = _walk(hist_ptr, k, P, TOP)
        valid = valid & ((key >> (TOP + 8 - 8 * P)) == (prefix >> (TOP + 8 - 8 * P)))
    digit = ((key >> (TOP - 8 * P)) & 255).to(tl.int32)
    h = tl.histogram(digit, 256, mask=valid)
    tl.atomic_add(hist_ptr + P * 256 + tl.arange(0, 256), h, mask=h > 0, sem="relaxed")  # skip empty bins


@triton.jit
def _collect_kernel(x_ptr, lo_ptr, hi_ptr, k_ptr, ws_ptr, out_ptr, HKV: tl.constexpr, sx_r, sws_r, so_r,
                    BLOCK: tl.constexpr):
    """fp32 scores: every index above the threshold, then ties in atomic order."""
    key, valid, offs, k, hist_ptr = _block_keys(x_ptr, lo_ptr, hi_ptr, k_ptr, ws_ptr, HKV, sx_r, sws_r,
                                                BLOCK, False)
    r = tl.program_id(0)
    thresh, need = _walk(hist_ptr, k, 4, 24)
    gt = valid & (key > thresh)
    eq = valid & (key == thresh)
    cnt_ptr = hist_ptr + 4 * 256
    base_gt = tl.atomic_add(cnt_ptr, tl.sum(gt.to(tl.int32), axis=0), sem="relaxed")
    base_eq = tl.atomic_add(cnt_ptr + 1, tl.sum(eq.to(tl.int32), axis=0), sem="relaxed")
    slot_gt = base_gt + tl.cumsum(gt.to(tl.int32), axis=0) - 1
    slot_eq = base_eq + tl.cumsum(eq.to(tl.int32), axis=0) - 1
    tl.store(out_ptr + r * so_r + slot_gt, offs, mask=gt)
    tl.store(out_ptr + r * so_r + (k - need) + slot_eq, offs, mask=eq & (slot_eq < need))


@triton.jit
def _block_keys16(x_ptr, r, lo, hi, k, ws_ptr, sx_r, sws_r, BLOCK: tl.constexpr):
    """_block_keys for 16-bit keys of row r (its lo, hi and k loaded by _row_bounds), in blocks
    at multiples of BLOCK (not at lo) shaped [BLOCK / 8, 8], as (keys + 1 inside [lo, hi) and 0
    outside, offsets, row workspace): the loads are 16-byte vectors, and an index-order rank
    (_rank2d) scans 8 keys inside a thread before one short scan across threads (an sm_90
    compile of the collect: 1016 instructions instead of 1848 for a 1-D block at lo; H100: 207
    vs 221 us per 128K step at batch 8, bench/README.md)."""
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK // 8)[:, None] * 8 + tl.arange(0, 8)[None, :]
    # a load mask of whole 16-key runs vectorizes; the exact [lo, hi) test comes after
    in_load = (offs >= lo // 16 * 16) & (offs < (hi + 15) // 16 * 16) & (k > 0)
    key = tl.load(x_ptr + r * sx_r + offs, mask=in_load, other=0).to(tl.uint32)
    # keys + 1, and 0 outside [lo, hi) (one unsigned compare): the passes then test keys alone.
    # Masks kept as per-key booleans cost a predicate each, which an sm_90 build of the collect
    # spilled to registers and back (P2R / ISETP) around every use.
    inside = (offs - lo).to(tl.uint32) < (hi - lo).to(tl.uint32)
    return tl.where(inside, key + 1, 0), offs, ws_ptr + r * sws_r


@triton.jit
def _bounds_then_wait(lo_ptr, hi_ptr, k_ptr, HKV, USE_PDL: tl.constexpr, PRE_WAIT: tl.constexpr):
    """The program's row and its lo, hi, k, loaded before the PDL wait where PRE_WAIT (they come
    from before the step's first launch, sync.py), then the wait."""
    if not PRE_WAIT:
        pdl_enter(USE_PDL)
    r, lo, hi, k = _row_bounds(lo_ptr, hi_ptr, k_ptr, HKV)
    if PRE_WAIT:
        pdl_enter(USE_PDL)
    return r, lo, hi, k


@triton.jit
def _rank2d(x):
    """Exclusive index-order prefix sums of the 2-D int tensor x, and its total: a scan of the 8
    keys inside a thread, then one short scan across threads."""
    row = tl.sum(x, axis=1)
    return tl.cumsum(x, axis=1) - x + (tl.cumsum(row, axis=0) - row)[:, None], tl.sum(row, axis=0)


@triton.jit
def _pass1_16_kernel(x_ptr, lo_ptr, hi_ptr, k_ptr, ws_ptr, HKV: tl.constexpr, sx_r, sws_r, HEAD, BLOCK: tl.constexpr,
                     USE_PDL: tl.constexpr, PRE_WAIT: tl.constexpr = True):
    r, lo, hi, k = _bounds_then_wait(lo_ptr, hi_ptr, k_ptr, HKV, USE_PDL, PRE_WAIT)
    key1, offs, hist_ptr = _block_keys16(x_ptr, r, lo, hi, k, ws_ptr, sx_r, sws_r, BLOCK)
    _pass1_16(key1, hist_ptr, hist_ptr, k, HEAD)


@triton.jit
def _pass1_16(key1, src_ptr, hist_ptr, k, HEAD):
    """Radix pass 1 of one block's keys (key1: keys + 1, 0 outside [lo, hi)) for the k largest:
    pass 0's walk from the row histograms at src_ptr, pass 1 into those at hist_ptr (the same
    workspace, or a second selection's over the same keys and pass 0: topk_pair)."""
    prefix, krem = _walk(src_ptr, k, 1, 8)
    if tl.program_id(1) == 0:  # the collect resumes this walk (every program of the row has it)
        tl.store(hist_ptr + _WALK0, prefix.to(tl.int32))
        tl.store(hist_ptr + _WALK0 + 1, krem)
    key = key1 - 1  # 0xFFFFFFFF outside [lo, hi): its top digit matches no prefix
    cand = ((key >> 8) == (prefix >> 8)) & (k > 0)
    low = (key & 255).to(tl.int32)
    # element atomics into this block's histogram only, then the finished block histogram into
    # the row's: half the per-key atomics, each of which costs a branch in an sm_90 build
    block_hist = hist_ptr + HEAD + tl.program_id(1) * 256
    tl.atomic_add(block_hist + low, 1, mask=cand, sem="relaxed")
    tl.debug_barrier()  # bar.sync: the program's atomics are visible to all its threads
    bins = tl.arange(0, 256)
    h = tl.load(block_hist + bins, volatile=True)
    tl.atomic_add(hist_ptr + 256 + bins, h, mask=h > 0, sem="relaxed")


@triton.jit
def _collect16_kernel(x_ptr, lo_ptr, hi_ptr, k_ptr, ws_ptr, out_ptr, HKV: tl.constexpr, sx_r, sws_r, so_r, HEAD,
                      BLOCK: tl.constexpr, NB_PAD: tl.constexpr, USE_PDL: tl.constexpr, PRE_WAIT: tl.constexpr = True):
    r, lo, hi, k = _bounds_then_wait(lo_ptr, hi_ptr, k_ptr, HKV, USE_PDL, PRE_WAIT)
    key1, offs, hist_ptr = _block_keys16(x_ptr, r, lo, hi, k, ws_ptr, sx_r, sws_r, BLOCK)
    _collect16(key1, offs, hist_ptr, k, offs, out_ptr + r * so_r, HEAD, BLOCK, NB_PAD)


@triton.jit
def _collect16(key1, offs, hist_ptr, k, vals, out_ptr, HEAD, BLOCK: tl.constexpr, NB_PAD: tl.constexpr):
    """The collect of one block for the k largest keys whose passes are in hist_ptr: each chosen
    key's value (vals: its index, or what it maps to) into its slot of the row's out_ptr."""
    blk = tl.program_id(1)
    # pass 0's walk as pass 1 stored it, then pass 1's histogram
    thresh, need = _walk_from(hist_ptr, tl.load(hist_ptr + _WALK0).to(tl.uint32), tl.load(hist_ptr + _WALK0 + 1),
                              1, 2, 8)
    # in key1's space (k = 0: its empty histograms walk to 0xFFFF and nothing passes)
    gt = (key1 > thresh + 1) & (k > 0)
    eq = (key1 == thresh + 1) & (k > 0)
    # keys above and keys equal ranked in one scan, equal ones in the high half (a block holds
    # fewer than 2^16 keys): about half the blocks hold ties (ncu at 128K), which then needed a
    # second scan
    tl.static_assert(BLOCK < 65536)
    rank, total = _rank2d(gt.to(tl.int32) + (eq.to(tl.int32) << 16))
    base_gt = tl.atomic_add(hist_ptr + 4 * 256, total & 0xFFFF, sem="relaxed")
    # the row holds exactly k - need keys above the threshold, so the slots stay below k - need;
    # checked once per block (not per key) to keep out's other entries safe from a bad workspace
    in_bounds = base_gt + (total & 0xFFFF) <= k - need
    tl.store(out_ptr + base_gt + (rank & 0xFFFF), vals, mask=gt & in_bounds)
    if total > 0xFFFF:  # this block holds keys equal to the threshold
        bs = tl.arange(0, NB_PAD)  # ties in the blocks before this one, from their pass-1 histograms
        eq_before = tl.sum(tl.load(hist_ptr + HEAD + bs * 256 + (thresh & 255).to(tl.int32), mask=bs < blk,
                                   other=0), axis=0)
        slot_eq = eq_before + (rank >> 16)
        tl.store(out_ptr + (k - need) + slot_eq, vals, mask=eq & (slot_eq < need))


def topk16_ref(keys: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, k: torch.Tensor) -> list[torch.Tensor]:
    """Reference of radix_topk over 16-bit keys [R, N] (int32 codes): per row the k[r] largest
    keys in [lo[r], hi[r]), ties to the lowest indices (sorted by index)."""
    out = []
    for r in range(keys.shape[0]):
        lo_r, hi_r = int(lo[r]), int(hi[r])
        n = keys.shape[1]
        rank = keys[r].long() * (1 << 32) + ((1 << 32) - 1 - torch.arange(n, device=keys.device))
        out.append(torch.topk(rank[lo_r:hi_r], int(k[r])).indices.sort().values + lo_r)
    return out


def workspace(rows: int, device: torch.device | str, blocks: int = 0) -> torch.Tensor:
    """Histograms (4 x 256) and two counters per row, then `blocks` block histograms of 256
    (16-bit keys: one per radix block; they use histograms 0 and 1, and pass 1 leaves its walk
    of histogram 0 for the collect where histogram 2 would be); must be zero before each select."""
    return torch.zeros(rows, _HEAD + blocks * _BINS, dtype=torch.int32, device=device)


def blocks16(n: int, block: int) -> int:
    """Radix blocks of a row of n 16-bit keys (the workspace needs this many block histograms)."""
    return triton.cdiv(n, block)


def radix_topk(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, k: torch.Tensor, out: torch.Tensor,
               ws: torch.Tensor | None = None, block: int = 4096, hist0_done: bool = False,
               num_warps: int = 4, pdl: bool = False, pre_wait: bool = True, nb_pad: int = 0) -> torch.Tensor:
    """x [B, Hkv, N] fp32 scores, or uint16 keys (keys16: ties to the lowest index); lo, hi,
    k [B] int32 (k <= hi - lo) -> out [B, Hkv, K_max] int32.

    Row (b, h) gets its k[b] indices in out[b, h, :k[b]]; the rest of out is left as is.
    `ws` (see `workspace`) is zeroed here; pass a static one inside a captured graph.
    hist0_done: the producer of x already zeroed ws and added pass 0's histogram
    (dense_select.dense_scores does, fused with the scores), so start at pass 1. num_warps
    applies to the 16-bit passes; pdl (16-bit passes after pass 0): programmatic dependent launch;
    pre_wait (with pdl): those passes load lo, hi and k before waiting (they must come from
    before the step's first launch, sync.py). nb_pad: the 16-bit collect's compiled bound on a row's
    blocks (a power of two >= them; 0: the row's own), so rows of any length up to it share one build."""
    if x.dim() != 3 or x.dtype not in (torch.float32, torch.uint16) or x.stride(2) != 1:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} must be fp32 or uint16 [B, Hkv, N] contiguous in N")
    b, hkv, n = x.shape
    if n >= MAX_ROW:
        raise ValueError(f"rows of {n} keys: the radix walk packs counts below {MAX_ROW} per row")
    for name, t in (("lo", lo), ("hi", hi), ("k", k)):
        if t.shape != (b,) or t.dtype != torch.int32:
            raise ValueError(f"{name} {tuple(t.shape)} {t.dtype} must be int32 [{b}]")
    if out.shape[:2] != (b, hkv) or out.dtype != torch.int32 or out.stride(2) != 1:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must be int32 [{b}, {hkv}, K_max]")
    if x.stride(0) != hkv * x.stride(1) or out.stride(0) != hkv * out.stride(1):
        raise ValueError("x and out must have their (B, Hkv) dims mergeable into rows")
    if hist0_done and ws is None:
        raise ValueError("hist0_done needs the workspace that holds pass 0")
    key16 = x.dtype == torch.uint16
    nb = triton.cdiv(n, block)
    if not hist0_done:
        ws = workspace(b * hkv, x.device, nb if key16 else 0) if ws is None else ws.zero_()
    if key16 and (ws.shape[1] < _HEAD + nb * _BINS or ws.stride(1) != 1):
        raise ValueError(f"ws {tuple(ws.shape)} needs {_HEAD + nb * _BINS} columns for {nb} blocks of 16-bit keys")
    grid = (b * hkv, nb)
    if key16:
        if not hist0_done:
            _hist_kernel[grid](x, lo, hi, k, ws, hkv, x.stride(1), ws.stride(0), P=0, BLOCK=block, KEY16=True, TOP=8,
                               num_warps=num_warps)
        _pass1_16_kernel[grid](x, lo, hi, k, ws, hkv, x.stride(1), ws.stride(0), _HEAD, BLOCK=block,
                               num_warps=num_warps, USE_PDL=pdl, PRE_WAIT=pre_wait, **launch_opts(pdl))
        _collect16_kernel[grid](x, lo, hi, k, ws, out, hkv, x.stride(1), ws.stride(0), out.stride(1), _HEAD,
                                BLOCK=block, NB_PAD=max(nb_pad, triton.next_power_of_2(nb)), num_warps=num_warps,
                                USE_PDL=pdl, PRE_WAIT=pre_wait, **launch_opts(pdl))
        return out
    for p in range(1 if hist0_done else 0, _PASSES):
        _hist_kernel[grid](x, lo, hi, k, ws, hkv, x.stride(1), ws.stride(0), P=p, BLOCK=block, KEY16=False, TOP=24)
    _collect_kernel[grid](x, lo, hi, k, ws, out, hkv, x.stride(1), ws.stride(0), out.stride(1), BLOCK=block)
    return out
