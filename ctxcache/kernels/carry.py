"""CSAttention's reselect on the GPU: on a step between the estimate's, a row's re-rank candidates
are its previous selection, the successors of its previous best keys and the key new to the region
(methods.csattention_refs.carried_candidates is the per-row reference, `carry_ref` the batched one).

carry_row runs in the selector's follow launch, one program per (row, KV head) (kernels/follow.py:
rows that select get their successors promoted there, carried rows these candidates); rows not
carried keep the selector's candidates. The previous selection's kp
keys are distinct and inside [lo, hi - 1) (one key a step); a successor is kept where inside [lo, hi) and not among them, found by comparing the F
successors with the selection block by block (no sort, and no per-key bitmap to clear); the new
key hi - 1 where no kept successor is it. Written in that order, then -1 up to kc (the re-rank
masks it), so a step's candidates are kp + F + 1 slots at most."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


BLOCK = 256  # selection keys compared with the successors per inner step


@triton.jit
def carry_row(prev_ptr, cand_ptr, succ, keep, lo, hi, kp, kc, BLOCK: tl.constexpr):
    """One (row, KV head)'s carried candidates into cand_ptr (its row), from its last selection at
    prev_ptr (kp keys) and its successors succ [FP] where keep (inside [lo, hi)); after the wait."""
    for start in range(0, kp, BLOCK):
        s = start + tl.arange(0, BLOCK)
        ok = s < kp
        chosen = tl.load(prev_ptr + s, mask=ok, other=-1)
        tl.store(cand_ptr + s, chosen, mask=ok)
        hit = tl.max((succ[:, None] == chosen[None, :]).to(tl.int32), axis=1)
        keep = keep & (hit == 0)
    taken = tl.cumsum(keep.to(tl.int32), 0)
    tl.store(cand_ptr + kp + taken - 1, succ, mask=keep)
    n_succ = tl.sum(keep.to(tl.int32), 0)
    new = hi - 1
    new_ok = (new >= lo) & (tl.sum((keep & (succ == new)).to(tl.int32), 0) == 0)
    tl.store(cand_ptr + kp + n_succ, new, mask=new_ok)
    for start in range(kp + n_succ + new_ok.to(tl.int32), kc, BLOCK):
        s = start + tl.arange(0, BLOCK)
        tl.store(cand_ptr + s, tl.full([BLOCK], -1, tl.int32), mask=s < kc)


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
