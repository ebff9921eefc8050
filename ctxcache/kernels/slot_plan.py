"""One-launch slot plan for the GPU cache of the CPU<->GPU mode (decoder/gpu/offload.py).

The torch version (offload.plan_slots_ref) costs ~20 small launches, measured 190 µs per layer
at 128K batch 1 on the H100, more than the selection itself. Here one program per (row, KV
head) does the same three passes over its selection: (1) look up each selected position's slot
and stamp the hit slots busy, (2) list free (unstamped) slots in slot order by a prefix sum, as
many as there are misses, (3) hand the misses, in selection order, the free slots, evicting what those held. Same result
as the torch version bit for bit. The stamp (step counter per row) replaces zeroing a busy map."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _plan_kernel(idx_ptr, ksel_ptr, slot_of_ptr, tag_ptr, busy_ptr, free_ptr, stamp_ptr, ring_ptr, out_ptr, count_ptr,
                 HKV, KMAX, CAP, NSLOT,  # NSLOT = N + 1: slot_of's row length
                 BLOCK: tl.constexpr):
    row = tl.program_id(0)
    b = row // HKV
    r64 = row.to(tl.int64)
    k = tl.minimum(tl.load(ksel_ptr + b), KMAX)
    stamp = tl.load(stamp_ptr + row) + 1
    offs = tl.arange(0, BLOCK)
    n_hit = 0
    n_real = 0  # the selected positions less the -1 entries (a carried row's padding: no key)
    for j0 in range(0, k, BLOCK):  # pass 1: hits stamp their slots busy
        j = j0 + offs
        pos = tl.load(idx_ptr + r64 * KMAX + j, mask=j < k, other=-1)
        ok = (j < k) & (pos >= 0)
        held = tl.load(slot_of_ptr + r64 * NSLOT + pos, mask=ok, other=-1)
        hit = ok & (held >= 0)
        tl.store(busy_ptr + r64 * CAP + held, stamp, mask=hit)
        n_hit += tl.sum(hit.to(tl.int32), axis=0)
        n_real += tl.sum(ok.to(tl.int32), axis=0)
    tl.debug_barrier()
    n_free = 0
    need = n_real - n_hit  # the misses: pass 3 takes the first `need` free slots, no more are listed
    ring = tl.load(ring_ptr + row)
    # pass 2: free slots, those unused last step first (the least recent tier), each tier in ring
    # order from the pointer; busy holds each slot's last step of use (a hit or a fill). It stops
    # once the misses have theirs: listing all CAP slots twice (8 selections of 6K keys at 124K)
    # was most of the kernel (H200, 124K x 4: 162 us a layer, 5.2 ms a step)
    for tier in tl.static_range(2):
        s0 = 0
        while (s0 < CAP) & (n_free < need):
            s = (ring + s0 + offs) % CAP
            used = tl.load(busy_ptr + r64 * CAP + s, mask=s0 + offs < CAP, other=stamp)
            free = (s0 + offs < CAP) & ((used < stamp - 1) if tier == 0 else (used == stamp - 1))
            rank = n_free + tl.cumsum(free.to(tl.int32), axis=0) - 1
            tl.store(free_ptr + r64 * CAP + rank, s, mask=free)
            n_free += tl.sum(free.to(tl.int32), axis=0)
            s0 += BLOCK
    tl.debug_barrier()
    n_miss = 0
    for j0 in range(0, KMAX, BLOCK):  # pass 3: misses take free slots, in selection order
        j = j0 + offs
        pos = tl.load(idx_ptr + r64 * KMAX + j, mask=j < k, other=-1)
        ok = (j < k) & (pos >= 0)
        held = tl.load(slot_of_ptr + r64 * NSLOT + pos, mask=ok, other=-1)
        miss = ok & (held < 0)
        rank = n_miss + tl.cumsum(miss.to(tl.int32), axis=0) - 1
        dst = tl.load(free_ptr + r64 * CAP + rank, mask=miss, other=0)
        old = tl.load(tag_ptr + r64 * CAP + dst, mask=miss, other=-1)
        # evicted keys are never selected this step (they would have been hits), so these
        # stores touch other addresses than the loads of later blocks
        tl.store(slot_of_ptr + r64 * NSLOT + old, -1, mask=miss & (old >= 0))
        tl.store(slot_of_ptr + r64 * NSLOT + pos, dst, mask=miss)
        tl.store(tag_ptr + r64 * CAP + dst, pos, mask=miss)
        tl.store(busy_ptr + r64 * CAP + dst, stamp, mask=miss)
        res = tl.where(miss, -dst - 1, held)
        tl.store(out_ptr + r64 * KMAX + j, tl.where(j < KMAX, res, 0), mask=j < KMAX)
        n_miss += tl.sum(miss.to(tl.int32), axis=0)
    tl.store(stamp_ptr + row, stamp)
    last = tl.load(free_ptr + r64 * CAP + tl.maximum(n_miss - 1, 0))
    tl.store(ring_ptr + row, tl.where(n_miss > 0, (last + 1) % CAP, ring))
    tl.atomic_add(count_ptr, n_hit.to(tl.int64))
    tl.atomic_add(count_ptr + 1, n_real.to(tl.int64))


def plan_slots_kernel(idx: torch.Tensor, k_sel: torch.Tensor, slot_of: torch.Tensor, tag: torch.Tensor,
                      busy: torch.Tensor, free: torch.Tensor, stamp: torch.Tensor, ring: torch.Tensor,
                      counts: torch.Tensor, out: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """idx [B, Hkv, K] int32 (contiguous; -1: no key, neither hit nor miss, out -1), k_sel [B] int32; slot_of [B, Hkv, N+1], tag, busy,
    free [B, Hkv, C] int32; stamp, ring [B * Hkv] int32; counts [2] int64 (+= hits, selected).
    Writes out [B, Hkv, K] int32 (s >= 0 hit slot, -s-1 miss slot) and updates the cache."""
    bsz, hkv, kmax = idx.shape
    cap = tag.shape[-1]
    for t in (idx, slot_of, tag, busy, free, ring, out):
        if not t.is_contiguous() or t.dtype != torch.int32:
            raise ValueError("plan_slots_kernel needs contiguous int32 buffers")
    if kmax > cap or out.shape != idx.shape or busy.shape != tag.shape or free.shape != tag.shape:
        raise ValueError(f"shapes disagree: idx {tuple(idx.shape)}, tag {tuple(tag.shape)}, out {tuple(out.shape)}")
    _plan_kernel[(bsz * hkv,)](idx, k_sel, slot_of, tag, busy, free, stamp, ring, out, counts,
                               hkv, kmax, cap, slot_of.shape[-1], BLOCK=block)
    return out
