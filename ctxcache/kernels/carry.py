"""CSAttention's reselect on the GPU: on a step between the estimate's, a row's re-rank candidates
are its previous selection, the successors of its previous best keys and the key new to the region
(methods.csattention_refs.carried_candidates is the per-row reference, `carry_ref` the batched one).

One program per (row, KV head); rows not carried return after the wait (the selector wrote their
candidates). The previous selection's kp keys are distinct and inside [lo, hi - 1) (one key a
step); a successor is kept where inside [lo, hi) and not among them. Membership by a mark a
position (`mark`, int8 [rows, >= positions], zero between launches): the program marks its
selection, a barrier, reads the successors' marks, a barrier, clears what it marked: O(kp + F)
scattered bytes where comparing every successor with every selected key (O(kp x F) in registers)
took 11 us a layer (H200, 32K, no PDL). The new key hi - 1 where no kept successor is it. Written
in that order (selection, successors, new key), then -1 up to kc (the re-rank masks it), so a
step's candidates are kp + F + 1 slots at most. `zero` (a lean step, where no route launch runs):
the programs also zero that buffer (the re-rank's Top-K workspace) between them, after the wait,
as the route launch does otherwise."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ctxcache.kernels.follow import successors
from ctxcache.kernels.sync import launch_opts, pdl_enter

BLOCK = 256  # selection keys compared with the successors per inner step
Z_CHUNK: tl.constexpr = tl.constexpr(1024)  # int32 zeroed per store of the side job


@triton.jit
def _carry_kernel(prev_ptr, fprev_ptr, carried_ptr, lo_ptr, hi_ptr, kp_ptr, kc_ptr, cand_ptr, mark_ptr, z_ptr, ZN,
                  Z_PER, HKV, F, sp_r, sf_r, sc_r, sm_r, FP: tl.constexpr, BLOCK: tl.constexpr, ZERO: tl.constexpr,
                  USE_PDL: tl.constexpr):
    r = tl.program_id(0)
    b = r // HKV
    carried = tl.load(carried_ptr + b)
    lo = tl.load(lo_ptr + b)
    hi = tl.load(hi_ptr + b)
    kp = tl.load(kp_ptr + b)
    kc = tl.load(kc_ptr + b)
    succ, keep = successors(fprev_ptr + r * sf_r, lo, hi, F, FP)
    # the bounds and the last step's keys came before the step; the candidate buffer is the
    # previous layer's re-rank input until the wait
    pdl_enter(USE_PDL)
    if ZERO:  # the buffer's last readers (the previous layer's re-rank) are done after the wait
        z0 = r * Z_PER
        for start in range(z0, tl.minimum(z0 + Z_PER, ZN), Z_CHUNK):
            offs = start + tl.arange(0, Z_CHUNK)
            tl.store(z_ptr + offs, tl.zeros((Z_CHUNK,), tl.int32), mask=offs < tl.minimum(z0 + Z_PER, ZN))
    if carried != 0:
        row = cand_ptr + r.to(tl.int64) * sc_r
        marks = mark_ptr + r.to(tl.int64) * sm_r
        for start in range(0, kp, BLOCK):
            s = start + tl.arange(0, BLOCK)
            ok = s < kp
            chosen = tl.load(prev_ptr + r * sp_r + s, mask=ok, other=0)
            tl.store(row + s, chosen, mask=ok)
            tl.store(marks + chosen, tl.full([BLOCK], 1, tl.int8), mask=ok)
        tl.debug_barrier()  # every thread's marks are visible to the block
        keep = keep & (tl.load(marks + succ, mask=keep, other=0) == 0)
        tl.debug_barrier()  # read before cleared
        for start in range(0, kp, BLOCK):
            s = start + tl.arange(0, BLOCK)
            ok = s < kp
            chosen = tl.load(prev_ptr + r * sp_r + s, mask=ok, other=0)
            tl.store(marks + chosen, tl.zeros([BLOCK], tl.int8), mask=ok)
        taken = tl.cumsum(keep.to(tl.int32), 0)
        tl.store(row + kp + taken - 1, succ, mask=keep)
        n_succ = tl.sum(keep.to(tl.int32), 0)
        new = hi - 1
        new_ok = (new >= lo) & (tl.sum((keep & (succ == new)).to(tl.int32), 0) == 0)
        tl.store(row + kp + n_succ, new, mask=new_ok)
        for start in range(kp + n_succ + new_ok.to(tl.int32), kc, BLOCK):
            s = start + tl.arange(0, BLOCK)
            tl.store(row + s, tl.full([BLOCK], -1, tl.int32), mask=s < kc)


def carry_candidates(prev: torch.Tensor, follow_prev: torch.Tensor, carried: torch.Tensor, lo: torch.Tensor,
                     hi: torch.Tensor, kp: torch.Tensor, kc: torch.Tensor, cand: torch.Tensor, mark: torch.Tensor,
                     pdl: bool = False, zero: torch.Tensor | None = None) -> None:
    """prev [B, Hkv, >= kp] int32 (row b's first kp[b]: its previous selection), follow_prev
    [B, Hkv, F] int32 (-1: none), carried, lo, hi, kp, kc [B] int32: rows with carried != 0 get
    their candidates in cand [B, Hkv, >= kc] int32 (graph-safe; kc >= their count, kp + F + 1
    always is). mark: int8 [B, Hkv, > any position in prev], all zero (and left so). pdl: a
    programmatic dependent launch (sync.py). zero: a contiguous int32 buffer the same launch zeroes."""
    b, hkv, f = follow_prev.shape
    for name, t, dtype in (("prev", prev, torch.int32), ("follow_prev", follow_prev, torch.int32),
                           ("cand", cand, torch.int32), ("mark", mark, torch.int8)):
        if t.dtype != dtype or t.shape[:2] != (b, hkv) or t.stride(2) != 1 or t.stride(0) != hkv * t.stride(1):
            raise ValueError(f"{name} {tuple(t.shape)} {t.dtype} must be {dtype} [{b}, {hkv}, *], rows mergeable")
    if zero is not None and (zero.dtype != torch.int32 or not zero.is_contiguous()):
        raise ValueError(f"zero {zero.dtype} must be a contiguous int32 buffer")
    zn = zero.numel() if zero is not None else 0
    _carry_kernel[(b * hkv,)](prev, follow_prev, carried, lo, hi, kp, kc, cand, mark,
                              zero if zero is not None else cand, zn, -(-zn // (b * hkv)), hkv, f, prev.stride(1),
                              follow_prev.stride(1), cand.stride(1), mark.stride(1),
                              FP=max(16, triton.next_power_of_2(f)), BLOCK=BLOCK, ZERO=zero is not None,
                              USE_PDL=pdl, num_warps=4, **launch_opts(pdl))


def carry_ref(prev: torch.Tensor, follow_prev: torch.Tensor, carried: torch.Tensor, lo: torch.Tensor,
              hi: torch.Tensor, kp: torch.Tensor, kc: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    """Torch reference: cand with the carried rows' candidates written as the kernel writes them."""
    out = cand.clone()
    for b in range(cand.shape[0]):
        if not int(carried[b]):
            continue
        lo_b, hi_b, kp_b, kc_b = int(lo[b]), int(hi[b]), int(kp[b]), int(kc[b])
        for h in range(cand.shape[1]):
            chosen = prev[b, h, :kp_b].tolist()
            succ = [p + 1 for p in follow_prev[b, h].tolist()
                    if p >= 0 and lo_b <= p + 1 < hi_b and p + 1 not in set(chosen)]
            new = [hi_b - 1] if hi_b - 1 >= lo_b and hi_b - 1 not in succ else []
            row = chosen + succ + new
            out[b, h, :kc_b] = -1
            out[b, h, :len(row)] = torch.tensor(row, dtype=out.dtype)
    return out
