"""Radix pass 1 inside the score pass, on the threshold bin carried from the previous step
(issue 46, stage 1: score and select without a separate pass over every key's score).

Why: the 16-bit select after the score kernel (kernels/topk.py) is two launches over every key
of the row: pass 1 (the low-byte histogram of the keys whose top byte is the K-th key's, d0)
and the collect. Pass 1 needs d0, which needs the whole row's pass-0 histogram, so it cannot run
in the score kernel that builds that histogram, unless d0 is known in advance. Between decode
steps a row's (layer, KV head) K-th key moves little, so the previous step's d0 is a good guess
g: the score kernel (dense_dot8 with `guess`) also counts the low bytes of its keys whose top
byte is g, into exactly the block and row histograms pass 1 would have written for d0 = g.

Exactness never depends on the guess. The repair launch (in place of pass 1) walks pass 0 as
pass 1 does; where d0 == g (a hit) it only records the walk and returns; where not (a miss, and
every row's first step: the guess starts at -1) it redoes pass 1 for d0 from the stored keys, into
a separate row histogram (the score kernel's sums of bin g are in the usual one). The collect
reads whichever histogram its row's flag names, places ties by the block histograms as before
(ties to the lowest index), and stores d0 as the next step's guess. The selected set is the radix
select's, bit for bit (topk16_ref is the reference of both).

A hit saves pass 1's read of every key (2 B a key), its per-key atomics and its histogram
flushes; the score kernel pays a second shared-memory histogram over the keys of one top-byte bin
(a few percent of them) and its flush. A miss costs what the old chain costs plus that.
follow (kernels/follow.py): the promotion moves keys between bins after the score kernel, so
with a guess it also corrects the speculative histograms (promote_successors(spec=...)).

Workspace (topk.workspace, 16-bit keys): the flag sits at column SPEC_FLAG and the repair's
histogram at MISS_HIST, both in the rows' unused third and fourth histograms."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ctxcache.kernels.smem_hist import smem_hist_counts1
from ctxcache.kernels.sync import launch_opts
from ctxcache.kernels.topk import (_BINS, _HEAD, _WALK0, _block_keys16, _bounds_then_wait, _walk, blocks16,
                                   collect16_block)

SPEC_FLAG = 2 * _BINS + 2  # 1 where the row's guess was its d0 (after the walk stored at _WALK0)
MISS_HIST = 3 * _BINS  # the repair's pass-1 row histogram (a miss)
_FLAG = tl.constexpr(SPEC_FLAG)
_MISS = tl.constexpr(MISS_HIST)


@triton.jit
def spec_pass1_add(key, offs, lo, hi, k, g, hist_ptr, HEAD, BLOCK: tl.constexpr, RBLOCK: tl.constexpr,
                   SMEM: tl.constexpr):
    """In a score program of BLOCK keys (key [BLOCK] uint16 codes at offs): radix pass 1 for the
    guessed top byte g over its keys in [lo, hi), added to its radix block's histogram (blocks of
    RBLOCK keys, a multiple of BLOCK) and to the row's, as topk._pass1_16_kernel adds them where
    pass 0 walks to g. hist_ptr: the row's workspace."""
    valid = (offs >= lo) & (offs < hi) & (k > 0) & ((key >> 8).to(tl.int32) == g)
    low = (key & 255).to(tl.int32)
    if SMEM:
        count = smem_hist_counts1(low, valid, BLOCK)
    else:
        count = tl.histogram(low, 256, mask=valid)
    bins = tl.arange(0, 256)
    rblk = (tl.program_id(1) * BLOCK) // RBLOCK
    tl.atomic_add(hist_ptr + HEAD + rblk * 256 + bins, count, mask=count > 0, sem="relaxed")
    tl.atomic_add(hist_ptr + 256 + bins, count, mask=count > 0, sem="relaxed")


@triton.jit
def _repair_kernel(x_ptr, lo_ptr, hi_ptr, k_ptr, ws_ptr, guess_ptr, HKV: tl.constexpr, sx_r, sws_r, sg_r, HEAD,
                   BLOCK: tl.constexpr, USE_PDL: tl.constexpr, PRE_WAIT: tl.constexpr = True):
    r, lo, hi, k = _bounds_then_wait(lo_ptr, hi_ptr, k_ptr, HKV, USE_PDL, PRE_WAIT)
    hist_ptr = ws_ptr + r * sws_r
    prefix, krem = _walk(hist_ptr, k, 1, 8)
    # the guess is read after the wait: the previous step's collect of this layer wrote it
    miss = (prefix >> 8).to(tl.int32) != tl.load(guess_ptr + r * sg_r)
    if tl.program_id(1) == 0:  # the collect resumes this walk and reads the flag
        tl.store(hist_ptr + _WALK0, prefix.to(tl.int32))
        tl.store(hist_ptr + _WALK0 + 1, krem)
        tl.store(hist_ptr + _FLAG, 1 - miss.to(tl.int32))
    if miss:  # pass 1 for the real d0, as topk._pass1_16_kernel
        key1, offs, _ = _block_keys16(x_ptr, r, lo, hi, k, ws_ptr, sx_r, sws_r, BLOCK)
        key = key1 - 1
        cand = (key >> 8) == (prefix >> 8)
        block_hist = hist_ptr + HEAD + tl.program_id(1) * 256
        bins = tl.arange(0, 256)
        # this program owns its block's histogram; the score kernel counted bin g into it. An
        # atomic exchange (not a store) so the zeros sit in L2 before the element atomics
        tl.atomic_xchg(block_hist + bins, tl.zeros([256], tl.int32), sem="relaxed")
        tl.debug_barrier()
        tl.atomic_add(block_hist + (key & 255).to(tl.int32), 1, mask=cand, sem="relaxed")
        tl.debug_barrier()
        h = tl.load(block_hist + bins, volatile=True)
        tl.atomic_add(hist_ptr + _MISS + bins, h, mask=h > 0, sem="relaxed")


@triton.jit
def _spec_collect_kernel(x_ptr, lo_ptr, hi_ptr, k_ptr, ws_ptr, out_ptr, guess_ptr, HKV: tl.constexpr, sx_r, sws_r,
                         so_r, sg_r, HEAD, BLOCK: tl.constexpr, NB_PAD: tl.constexpr, USE_PDL: tl.constexpr,
                         PRE_WAIT: tl.constexpr = True):
    r, lo, hi, k = _bounds_then_wait(lo_ptr, hi_ptr, k_ptr, HKV, USE_PDL, PRE_WAIT)
    hit = tl.load(ws_ptr + r * sws_r + _FLAG)
    thresh = collect16_block(x_ptr, r, lo, hi, k, ws_ptr, out_ptr, sx_r, sws_r, so_r, HEAD,
                             (1 - hit) * (_MISS - 256), BLOCK, NB_PAD)
    if tl.program_id(1) == 0:  # every program of the row has read the guess (the repair did, one launch back)
        tl.store(guess_ptr + r * sg_r, (thresh >> 8).to(tl.int32))


def spec_finish(keys: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, k: torch.Tensor, out: torch.Tensor,
                ws: torch.Tensor, guess: torch.Tensor, block: int, num_warps: int = 4, pdl: bool = False,
                pre_wait: bool = True) -> torch.Tensor:
    """The select after dense_dot8(guess=guess, radix_block=block) (and promote_successors with
    the same guess): keys [B, Hkv, N] uint16, lo, hi, k [B] int32, out [B, Hkv, K_max] int32, ws
    the workspace the score kernel filled, guess [B, Hkv] int32 (read, then set to this step's d0).
    Row (b, h) gets its k[b] indices in out[b, h, :k[b]], as radix_topk(hist0_done=True)."""
    b, hkv, n = keys.shape
    if keys.dtype != torch.uint16 or keys.stride(2) != 1 or keys.stride(0) != hkv * keys.stride(1):
        raise ValueError(f"keys {tuple(keys.shape)} {keys.dtype} must be uint16 [B, Hkv, N], rows mergeable")
    if out.shape[:2] != (b, hkv) or out.dtype != torch.int32 or out.stride(2) != 1 or out.stride(0) != hkv * out.stride(1):
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must be int32 [{b}, {hkv}, K_max], rows mergeable")
    check_guess(guess, b, hkv)
    nb = blocks16(n, block)
    if ws.shape[1] < _HEAD + nb * _BINS or ws.stride(1) != 1:
        raise ValueError(f"ws {tuple(ws.shape)} needs {_HEAD + nb * _BINS} columns for {nb} blocks")
    grid = (b * hkv, nb)
    sg = guess.stride(1)
    _repair_kernel[grid](keys, lo, hi, k, ws, guess, hkv, keys.stride(1), ws.stride(0), sg, _HEAD, BLOCK=block,
                         num_warps=num_warps, USE_PDL=pdl, PRE_WAIT=pre_wait, **launch_opts(pdl))
    _spec_collect_kernel[grid](keys, lo, hi, k, ws, out, guess, hkv, keys.stride(1), ws.stride(0), out.stride(1), sg,
                               _HEAD, BLOCK=block, NB_PAD=triton.next_power_of_2(nb), num_warps=num_warps,
                               USE_PDL=pdl, PRE_WAIT=pre_wait, **launch_opts(pdl))
    return out


def check_guess(guess: torch.Tensor, b: int, hkv: int) -> None:
    """A guess is int32 [B, Hkv] with its (B, Hkv) dims mergeable into rows."""
    if guess.shape != (b, hkv) or guess.dtype != torch.int32 or guess.stride(0) != hkv * guess.stride(1):
        raise ValueError(f"guess {tuple(guess.shape)} {guess.dtype} must be int32 [{b}, {hkv}], rows mergeable")


def spec_hist_ref(codes: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, k: torch.Tensor, guess: torch.Tensor,
                  block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of what the score kernel adds for a guess: codes [R, N] int32 16-bit keys,
    lo, hi, k per row [R], guess [R] -> (row histogram [R, 256], block histograms [R, nb, 256])
    of the low bytes of the keys in [lo, hi) whose top byte is the guess (none where k = 0)."""
    r_n, n = codes.shape
    nb = blocks16(n, block)
    rows, blocks = torch.zeros(r_n, _BINS, dtype=torch.int32), torch.zeros(r_n, nb, _BINS, dtype=torch.int32)
    pos = torch.arange(n)
    for r in range(r_n):
        sel = (pos >= int(lo[r])) & (pos < int(hi[r])) & (codes[r] >> 8 == int(guess[r])) & (int(k[r]) > 0)
        flat = (pos[sel] // block) * _BINS + (codes[r, sel] & 255).long()
        blocks[r] = torch.bincount(flat, minlength=nb * _BINS).int().view(nb, _BINS)
        rows[r] = blocks[r].sum(0)
    return rows, blocks


def guess_state(rows: int, n_kv: int, device: torch.device | str) -> torch.Tensor:
    """A layer's guesses [rows, Hkv] before any step: -1 (no top byte), so the first step misses."""
    return torch.full((rows, n_kv), -1, dtype=torch.int32, device=device)
