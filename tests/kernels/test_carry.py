"""CSAttention's reselect on the GPU: the carried rows' candidates (kernels/carry.py) against its
torch reference, and as a set against the method's per-row reference."""

import torch

from ctxcache.kernels.carry import carry_candidates, carry_ref
from ctxcache.methods.csattention_refs import carried_candidates


def _inputs(gen: torch.Generator):
    b, hkv, f, k_max, width = 3, 2, 24, 600, 700
    lo = torch.tensor([4, 4, 4], dtype=torch.int32)
    hi = torch.tensor([5000, 900, 3000], dtype=torch.int32)
    kp = torch.tensor([500, 40, 600], dtype=torch.int32)
    prev = torch.full((b, hkv, k_max), 7, dtype=torch.int32)  # past kp: stale entries the kernel must not read
    fprev = torch.full((b, hkv, f), -1, dtype=torch.int32)
    for r in range(b):
        for h in range(hkv):
            region = torch.randperm(int(hi[r]) - 1 - 4, generator=gen)[:int(kp[r])] + 4  # inside [lo, hi - 1)
            prev[r, h, :int(kp[r])] = region.int()
            best = region[:f].clone()  # the follow keys are among the selection
            best[:3] = torch.tensor([int(hi[r]) - 2, 3 - 1, int(region[0]) - 1])  # new key, outside, a selected successor
            prev[r, h, 0] = int(best[2]) + 1
            fprev[r, h] = best.int()
    fprev[1, 1, 10:] = -1
    carried = torch.tensor([1, 1, 0], dtype=torch.int32)
    kc = kp + f + 1
    cand = torch.full((b, hkv, width), 9, dtype=torch.int32)
    return prev, fprev, carried, lo, hi, kp, kc, cand


def _marks(prev, hi, device):
    """The kernel's zeroed position marks, wide enough for every position of these rows."""
    return torch.zeros(*prev.shape[:2], int(hi.max()) + 1, dtype=torch.int8, device=device)


def test_carried_rows_get_the_selection_then_new_successors_then_the_new_key(device):
    gen = torch.Generator().manual_seed(0)
    prev, fprev, carried, lo, hi, kp, kc, cand = _inputs(gen)
    want = carry_ref(prev, fprev, carried, lo, hi, kp, kc, cand)
    assert torch.equal(want[2], cand[2])  # a row not carried keeps the selector's candidates
    got, mark = cand.to(device), _marks(prev, hi, device)
    carry_candidates(*(t.to(device) for t in (prev, fprev, carried, lo, hi, kp, kc)), got, mark)
    assert torch.equal(got.cpu(), want)
    assert int(mark.abs().sum()) == 0  # left as it came: zero
    for r in (0, 1):
        extra = {"chosen_prev": prev[r, :, :int(kp[r])].long(), "chosen_hi": int(hi[r]) - 1,
                 "follow_prev": fprev[r].long()}
        ref, valid = carried_candidates(extra, int(lo[r]), int(hi[r]), 1)
        for h in range(2):
            row = want[r, h, :int(kc[r])]
            assert sorted(row[row >= 0].tolist()) == ref[h][valid[h]].tolist()


def test_a_lean_step_launch_also_zeroes_the_workspace(device):
    """zero: the re-rank's Top-K workspace zeroed by the same launch (no route launch on a lean
    step), every element whatever the split between programs, the candidates as without it."""
    prev, fprev, carried, lo, hi, kp, kc, cand = _inputs(torch.Generator().manual_seed(1))
    want = carry_ref(prev, fprev, carried, lo, hi, kp, kc, cand)
    for n in (1, 5, 3000, 6 * 1024 + 7):
        ws = torch.full((n,), 3, dtype=torch.int32, device=device)
        got = cand.to(device)
        carry_candidates(*(t.to(device) for t in (prev, fprev, carried, lo, hi, kp, kc)), got,
                         _marks(prev, hi, device), zero=ws)
        assert torch.equal(got.cpu(), want)
        assert int(ws.abs().sum()) == 0, n
