"""CSAttention's reselect on the GPU: the carried rows' candidates (kernels/carry.py, written in
the follow launch) against their torch reference, and that as a set against the method's."""

import torch

from ctxcache.kernels.carry import carry_ref
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


def test_carried_rows_get_the_method_candidates_selection_first():
    """carry_ref (the kernel's reference) against the method's per-row reference, as sets."""
    gen = torch.Generator().manual_seed(0)
    prev, fprev, carried, lo, hi, kp, kc, cand = _inputs(gen)
    want = carry_ref(prev, fprev, carried, lo, hi, kp, kc, cand)
    assert torch.equal(want[2], cand[2])  # a row not carried keeps the selector's candidates
    assert torch.equal(want[0, :, :int(kp[0])], prev[0, :, :int(kp[0])])
    for r in (0, 1):
        extra = {"chosen_prev": prev[r, :, :int(kp[r])].long(), "chosen_hi": int(hi[r]) - 1,
                 "follow_prev": fprev[r].long()}
        ref, valid = carried_candidates(extra, int(lo[r]), int(hi[r]), 1)
        for h in range(2):
            row = want[r, h, :int(kc[r])]
            assert sorted(row[row >= 0].tolist()) == ref[h][valid[h]].tolist()


def test_the_follow_launch_promotes_selecting_rows_and_carries_the_others(device):
    """With Carry, promote_successors' launch does both: rows that select (k > 0) get their
    successors promoted, carried rows (k 0 there) their candidates, as carry_ref writes them."""
    from ctxcache.kernels.follow import Carry, promote_ref, promote_successors
    from ctxcache.kernels.topk import blocks16, key16_codes, workspace

    gen = torch.Generator().manual_seed(1)
    prev, fprev, carried, lo, hi, kp, kc, cand = _inputs(gen)
    n = 5008
    keys = torch.randint(0, 0xFC00, (3, 2, n), generator=gen, dtype=torch.int32).short().view(torch.uint16)
    sel_hi = torch.where(carried.bool(), lo, hi)
    sel_k = torch.where(carried.bool(), 0, kp)
    want_cand = carry_ref(prev, fprev, carried, lo, hi, kp, kc, cand)
    want_codes = promote_ref(keys, fprev, lo, sel_hi, sel_k)
    d = [t.to(device) for t in (keys, prev, fprev, carried, lo, hi, kp, kc, cand, sel_hi, sel_k)]
    kd, pd, fd, cd, lod, hid, kpd, kcd, cand_d, shd, skd = d
    ws = workspace(6, device, blocks16(n, 1024))
    promote_successors(kd, ws, fd, lod, shd, skd, carry=Carry(pd, cd, hid, kpd, kcd, cand_d))
    assert torch.equal(cand_d.cpu(), want_cand)
    assert torch.equal(key16_codes(kd.cpu()), want_codes)
