"""Exact Top-K over 16-bit keys in one launch after the score kernel (replaces radix pass 1 +
collect, two launches with per-candidate atomics).

The producer (dense_keys.dense_keys) leaves, per row, the histogram of the keys' top byte
over [lo, hi) (`hist0`, by atomics) and, per block of BLOCK keys, its suffix counts
`ge[blk, d]` = keys of the block with top byte >= d (plain stores). Then every program of
this kernel, one per (row, block):
1. walks hist0 to the K-th key's top byte b0: keys above b0 are selected outright (g0 of
   them), keys equal to b0 are candidates;
2. writes its winners to out[g0-prefix ...] and its candidates (low byte, index) to a
   candidate list, both at positions given by the earlier blocks' ge counts, so both lists
   are in index order with no atomics;
3. adds its candidates' low-byte histogram to the row's hist1 and counts itself in; the
   program that arrives last (sync.arrive_last) walks hist1 to the exact threshold, appends
   the winning candidates (ties to the lowest index) to out[g0:k], and zeroes the row's
   histograms and counter for the next step.

Result per row: the k largest keys in [lo, hi), ties to the lowest index (topk.topk16_ref's
set), in the order winners-by-index then resolved-candidates-by-index (select16_ref).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ctxcache.kernels.sync import arrive_last, compiled, launch_opts, pdl_enter

BINS = 256
HEAD = 2 * BINS + 8  # per row: hist0, hist1, arrival counter (+ pad), then the block ge counts
MAX_INDEX = 1 << 24  # a candidate packs (low byte << 24) | index into one int32
_BINS = tl.constexpr(BINS)  # the same numbers as seen from inside kernels
_HEAD = tl.constexpr(HEAD)


def select16_ref(keys: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, k: torch.Tensor) -> list[torch.Tensor]:
    """keys [R, N] int32 codes in [0, 65536); rows r of batch r // (R // B). Per row: the
    k largest keys in [lo, hi), ties to the lowest index, as select16 orders them."""
    rows, out = keys.shape[0], []
    per_b = rows // lo.shape[0]
    for r in range(rows):
        b = r // per_b
        lo_r, hi_r, k_r = int(lo[b]), int(hi[b]), int(k[b])
        key = keys[r, lo_r:hi_r].long()
        pos = torch.arange(lo_r, hi_r, device=keys.device)
        if k_r == 0:
            out.append(pos[:0])
            continue
        kth = torch.sort(key, descending=True).values[k_r - 1]
        b0 = int(kth) >> 8
        win = pos[(key >> 8) > b0]
        cand = (key >> 8) == b0
        rank = key * (1 << 32) + ((1 << 32) - 1 - pos)  # key, then the lower index first
        chosen = torch.topk(torch.where(cand, rank, torch.full_like(rank, -1)), k_r - win.numel()).indices
        out.append(torch.cat([win, pos[chosen].sort().values]))
    return out


@triton.jit
def _walk256(hist, k, bins):
    """Digit d of the k-th largest key in a 256-bin histogram, and the count above d."""
    ge = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist  # count with digit >= d
    d = tl.max(tl.where(ge >= k, bins, -1), axis=0)
    return d, tl.sum(tl.where(bins > d, hist, 0), axis=0)


@triton.jit
def _resolve(ws, cand_ptr, out_ptr, k, b0, g0, h0, bins, N_PAD, CHUNK: tl.constexpr):
    """Last program of a row: exact threshold among the candidates, append the winners."""
    h1 = tl.load(ws + _BINS + bins, cache_modifier=".cg")  # filled by other programs' atomics
    t1, g1 = _walk256(h1, k - g0, bins)
    need_eq = k - g0 - g1  # candidates with low byte == t1 to take, lowest index first
    # clamped so that a stale workspace (a producer run without this kernel after it) can
    # never read or write out of bounds
    n_cand = tl.minimum(tl.sum(tl.where(bins == b0, h0, 0), axis=0), N_PAD)
    taken = tl.zeros((), tl.int32)
    ties = tl.zeros((), tl.int32)
    for c0 in range(0, n_cand, CHUNK):
        co = c0 + tl.arange(0, CHUNK)
        ok = co < n_cand
        cv = tl.load(cand_ptr + co, mask=ok, other=0, cache_modifier=".cg")
        low = (cv >> 24) & 255
        gt = ok & (low > t1)
        eq = ok & (low == t1)
        sel = gt | (eq & (ties + tl.cumsum(eq.to(tl.int32), axis=0) <= need_eq))
        pos = g0 + taken + tl.cumsum(sel.to(tl.int32), axis=0) - 1
        tl.store(out_ptr + pos, cv & 0xFFFFFF, mask=sel & (pos < k))
        taken += tl.sum(sel.to(tl.int32), axis=0)
        ties += tl.sum(eq.to(tl.int32), axis=0)
    zero = tl.zeros((_BINS,), tl.int32)
    tl.store(ws + bins, zero)
    tl.store(ws + _BINS + bins, zero)
    tl.store(ws + 2 * _BINS + tl.arange(0, 8), tl.zeros((8,), tl.int32))


@triton.jit
def _select16_kernel(keys_ptr, lo_ptr, hi_ptr, k_ptr, ws_ptr, cand_ptr, out_ptr, HKV, NB, N_PAD,
                     sk_r, sws_r, sc_r, so_r, PER: tl.constexpr, BLOCK: tl.constexpr,
                     NB_PAD: tl.constexpr, CHUNK: tl.constexpr, GPU: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    r = tl.program_id(0)
    blk = tl.program_id(1)
    b = r // HKV
    lo = tl.load(lo_ptr + b)
    hi = tl.load(hi_ptr + b)
    k = tl.load(k_ptr + b)
    ws = ws_ptr + r * sws_r
    bins = tl.arange(0, _BINS)
    h0 = tl.load(ws + bins)
    b0, g0 = _walk256(h0, k, bins)
    # keys above / at b0 in the earlier producer blocks (this program spans PER of them)
    bs = tl.arange(0, NB_PAD)
    before = bs < blk * PER
    ge_ptr = ws + _HEAD + bs * _BINS
    ge_at = tl.load(ge_ptr + b0, mask=before, other=0)
    ge_above = tl.load(ge_ptr + b0 + 1, mask=before & (b0 < _BINS - 1), other=0)
    pre_win = tl.sum(ge_above, axis=0)
    pre_cand = tl.sum(ge_at - ge_above, axis=0)
    offs = blk * BLOCK + tl.arange(0, BLOCK)  # blocks are aligned to 0, as the producer's
    valid = (offs >= lo) & (offs < hi) & (k > 0)
    key = tl.load(keys_ptr + r * sk_r + offs, mask=valid, other=0).to(tl.int32)
    digit = key >> 8
    win = valid & (digit > b0)
    cand = valid & (digit == b0)
    pos_win = pre_win + tl.cumsum(win.to(tl.int32), axis=0) - 1
    tl.store(out_ptr + r * so_r + pos_win, offs, mask=win & (pos_win < k))
    low = key & 255
    pos_cand = pre_cand + tl.cumsum(cand.to(tl.int32), axis=0) - 1
    tl.store(cand_ptr + r * sc_r + pos_cand, (low << 24) | offs, mask=cand & (pos_cand < N_PAD))
    h1 = tl.histogram(low, _BINS, mask=cand)
    tl.atomic_add(ws + _BINS + bins, h1, mask=h1 > 0, sem="relaxed")
    if arrive_last(ws + 2 * _BINS, NB, GPU):
        _resolve(ws, cand_ptr + r * sc_r, out_ptr + r * so_r, k, b0, g0, h0, bins, N_PAD, CHUNK)


def workspace16(rows: int, n_pad: int, block: int, device: torch.device | str) -> torch.Tensor:
    """Per row: hist0, hist1, counter, then n_pad / block producer-block ge counts. Zero once at
    allocation; select16 leaves the histograms and counter zeroed again after every call."""
    if n_pad % block:
        raise ValueError(f"n_pad={n_pad} must be a multiple of the producer block {block}")
    return torch.zeros(rows, HEAD + (n_pad // block) * BINS, dtype=torch.int32, device=device)


def select16(keys: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, k: torch.Tensor, ws: torch.Tensor,
             cand: torch.Tensor, out: torch.Tensor, producer_block: int, block: int = 4096,
             pdl: bool = False) -> torch.Tensor:
    """keys [B, Hkv, N_pad] uint16 (dense_keys output); lo, hi, k [B] int32; ws from
    workspace16 holding the producer's hist0 and ge counts; cand [B, Hkv, N_pad] int32 scratch
    -> out [B, Hkv, K_max] int32 with row (b, h)'s selection in out[b, h, :k[b]]."""
    b, hkv, n_pad = keys.shape
    if keys.dtype != torch.uint16 or keys.stride(2) != 1 or keys.stride(0) != hkv * keys.stride(1):
        raise ValueError(f"keys {tuple(keys.shape)} {keys.dtype} must be uint16 [B, Hkv, N] with mergeable rows")
    for name, t in (("lo", lo), ("hi", hi), ("k", k)):
        if t.shape != (b,) or t.dtype != torch.int32:
            raise ValueError(f"{name} {tuple(t.shape)} {t.dtype} must be int32 [{b}]")
    if block % producer_block or n_pad % block:
        raise ValueError(f"block {block} must be a multiple of the producer block {producer_block} and divide "
                         f"N_pad={n_pad}")
    if n_pad > MAX_INDEX:
        raise ValueError(f"N_pad={n_pad} exceeds the {MAX_INDEX} keys a packed candidate can index")
    nb_prod = n_pad // producer_block
    if ws.shape != (b * hkv, HEAD + nb_prod * BINS) or ws.dtype != torch.int32 or not ws.is_contiguous():
        raise ValueError(f"ws {tuple(ws.shape)} must be workspace16({b * hkv}, {n_pad}, {producer_block})")
    if cand.shape != keys.shape or cand.dtype != torch.int32 or cand.stride(2) != 1:
        raise ValueError(f"cand {tuple(cand.shape)} {cand.dtype} must be int32 {tuple(keys.shape)}")
    if out.shape[:2] != (b, hkv) or out.dtype != torch.int32 or out.stride(2) != 1 \
            or out.stride(0) != hkv * out.stride(1):
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must be int32 [{b}, {hkv}, K_max]")
    nb = n_pad // block
    _select16_kernel[(b * hkv, nb)](
        keys, lo, hi, k, ws, cand, out, hkv, nb, n_pad, keys.stride(1), ws.stride(0), cand.stride(1), out.stride(1),
        PER=block // producer_block, BLOCK=block, NB_PAD=triton.next_power_of_2(nb_prod), CHUNK=2048,
        GPU=compiled(keys), USE_PDL=pdl, num_warps=8 if block >= 4096 else 4, **launch_opts(pdl))
    return out
