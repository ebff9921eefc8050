"""Radix pass 1 speculated in the score kernel (kernels/spec_select) selects exactly what the
radix chain selects, whether the carried guess hits or misses: ties to the lowest index, ragged
rows, streamed keys, follow's promotion, k = 0 and k = all of [lo, hi)."""

import pytest
import torch

from ctxcache.kernels.dense_dot8 import dense_dot8
from ctxcache.kernels.follow import promote_ref, promote_successors
from ctxcache.kernels.spec_select import MISS_HIST, SPEC_FLAG, guess_state, spec_finish, spec_hist_ref
from ctxcache.kernels.topk import _BINS, _HEAD, blocks16, key16_codes, radix_topk, topk16_ref, workspace

from test_dense_select import _setup

N_MAX, BLOCK, RBLOCK = 768, 64, 128  # score programs of 64 keys, radix blocks of two of them


def _case(device, ties: bool):
    ids, w, dense, new, n_ctx, start, count = _setup(device, n=704)
    ids, w = ids[:, ::3].contiguous(), w[:, ::3].contiguous()  # group routing: one row set per KV head
    if ties:  # few distinct int8 values and unit scales: many keys share a score
        dense = torch.randint(-2, 3, dense.shape, device=device).to(torch.int8)
        scale = torch.ones(dense.shape[:4], device=device)
        w = torch.ones_like(w)
    else:
        dense = (dense.float() * 40).clamp(-127, 127).to(torch.int8)
        scale = torch.rand(dense.shape[:4], device=device) + 0.5
    return ids, w, dense, scale, new, n_ctx, start, count


def _score(device, case, k, guess, prev=None):
    """dense_dot8 (speculating where guess is given), then follow's promotion: (keys, ws, lo, hi)."""
    ids, w, dense, scale, new, n_ctx, start, count = case
    b, hkv = ids.shape[0], dense.shape[1]
    lo = torch.tensor([4, 0], dtype=torch.int32, device=device)
    hi = (n_ctx + count - 2).int()
    keys = torch.full((b, hkv, N_MAX), 7, dtype=torch.uint16, device=device)
    ws = workspace(b * hkv, device, blocks16(N_MAX, RBLOCK))
    dense_dot8(*case, lo, hi, k, keys, ws, block=BLOCK, guess=guess, radix_block=RBLOCK)
    if prev is not None:
        promote_successors(keys, ws, prev, lo, hi, k, guess, RBLOCK)
    return keys, ws, lo, hi


def _d0(codes, lo, hi, k, hkv):
    """Each row's threshold top byte (the k-th largest key's), -2 where k = 0 (no guess matches)."""
    out = []
    for r in range(codes.shape[0]):
        kk = int(k[r // hkv])
        seg = codes[r, int(lo[r // hkv]):int(hi[r // hkv])]
        out.append(int(seg.sort(descending=True).values[kk - 1]) >> 8 if kk else -2)
    return torch.tensor(out, dtype=torch.int32)


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("guessing", ["hit", "miss", "none", "mixed"])
@pytest.mark.parametrize("follow", [False, True])
def test_spec_select_equals_the_radix_chain(device, ties, guessing, follow):
    _check(device, ties, guessing, follow, (37, 20))


@pytest.mark.parametrize("guessing", ["hit", "miss"])
def test_spec_select_when_promoted_keys_hold_the_threshold(device, guessing):
    """k below the promoted successors' count: d0 is the top bin (0xFF), where the promotion
    moves keys into the guessed bin rather than out of it."""
    _check(device, False, guessing, True, (5, 3))


def _check(device, ties, guessing, follow, k_vals):
    case = _case(device, ties)
    b, hkv = case[0].shape[0], case[2].shape[1]
    k = torch.tensor(k_vals, dtype=torch.int32, device=device)
    prev = None
    if follow:  # distinct previous keys (a Top-K's), some -1, one whose successor is past hi
        prev = torch.stack([torch.randperm(600)[:12] for _ in range(b * hkv)]).int().view(b, hkv, 12)
        prev[:, :, :2] = -1
        prev[1, :, 2] = 700
        prev = prev.to(device)
    # the guess needs the true d0: find it with a first speculation-free score
    keys0, _, lo, hi = _score(device, case, k, None, prev)
    codes0 = key16_codes(keys0.cpu()).view(b * hkv, -1)
    d0 = _d0(codes0, lo.cpu(), hi.cpu(), k.cpu(), hkv)
    g = {"hit": d0, "miss": d0 - 1, "none": torch.full_like(d0, -1),
         "mixed": torch.where(torch.arange(b * hkv) % 2 == 0, d0, d0 + 1)}[guessing]
    guess = g.view(b, hkv).to(device).clone()  # the collect rewrites it: g stays the guess
    keys, ws, lo, hi = _score(device, case, k, guess.clone(), None)

    # what the score kernel added for the guess, before any promotion
    codes = key16_codes(keys.cpu()).view(b * hkv, -1)
    assert torch.equal(codes, key16_codes(_score(device, case, k, None)[0].cpu()).view(b * hkv, -1))
    rows, blocks = spec_hist_ref(codes, lo.repeat_interleave(hkv).cpu(), hi.repeat_interleave(hkv).cpu(),
                                 k.repeat_interleave(hkv).cpu(), g, RBLOCK)
    w = ws.cpu()
    assert torch.equal(w[:, _BINS:2 * _BINS], rows)
    assert torch.equal(w[:, _HEAD:].view(b * hkv, -1, _BINS), blocks)

    # the whole chain, with follow's promotion between the score and the select
    keys, ws, lo, hi = _score(device, case, k, guess, prev)
    out = torch.full((b, hkv, 40), -1, dtype=torch.int32, device=device)
    spec_finish(keys, lo, hi, k, out, ws, guess, RBLOCK)
    want_codes = (promote_ref(keys0, prev, lo, hi, k) if follow else key16_codes(keys0)).cpu().view(b * hkv, -1)
    refs = topk16_ref(want_codes, lo.repeat_interleave(hkv).cpu(), hi.repeat_interleave(hkv).cpu(),
                      k.repeat_interleave(hkv).cpu())
    flat = out.view(b * hkv, -1).cpu()
    for r in range(b * hkv):
        kk = int(k[r // hkv])
        assert torch.equal(flat[r, :kk].long().sort().values, refs[r])
        assert (flat[r, kk:] == -1).all()
    hit = ws.cpu()[:, SPEC_FLAG]
    d0_after = _d0(want_codes, lo.cpu(), hi.cpu(), k.cpu(), hkv)
    assert torch.equal(hit, (d0_after == g).int())
    if k_vals == (5, 3):
        assert (d0_after == 255).all()
    assert torch.equal(guess.cpu().view(-1), d0_after)  # the next step's guess: this step's d0
    assert (ws.cpu()[:, MISS_HIST:MISS_HIST + _BINS].sum(1) > 0).tolist() == (hit == 0).tolist()

    # the same set as the radix chain it replaces
    keys, ws, lo, hi = _score(device, case, k, None, prev)
    old = torch.full_like(out, -1)
    radix_topk(keys, lo, hi, k, old, ws, block=RBLOCK, hist0_done=True)
    assert torch.equal(old.cpu().sort(-1).values, out.cpu().sort(-1).values)


@pytest.mark.parametrize("k_rows", [(0, 20), ("all", 0)])
def test_spec_select_takes_none_or_every_key(device, k_rows):
    """k = 0 writes nothing; k = hi - lo takes every key of [lo, hi) (and after one step the
    guess hits, with the same answer)."""
    case = _case(device, ties=True)
    b, hkv = case[0].shape[0], case[2].shape[1]
    n_ctx, count = case[5], case[7]
    span = [int(n_ctx[r] + count[r] - 2) - (4 if r == 0 else 0) for r in range(b)]
    k = torch.tensor([span[r] if v == "all" else v for r, v in enumerate(k_rows)], dtype=torch.int32, device=device)
    guess = guess_state(b, hkv, device)
    got = []
    for _ in range(2):
        keys, ws, lo, hi = _score(device, case, k, guess)
        out = torch.full((b, hkv, max(span)), -1, dtype=torch.int32, device=device)
        spec_finish(keys, lo, hi, k, out, ws, guess, RBLOCK)
        got.append(out.cpu())
    assert torch.equal(got[0], got[1])
    for r, v in enumerate(k_rows):
        if v == 0:
            assert (got[0][r] == -1).all()
        elif v == "all":
            want = torch.arange(int(lo[r]), int(hi[r]))
            for h in range(hkv):
                assert torch.equal(got[0][r, h, :span[r]].long().sort().values, want)


def test_spec_select_refuses_a_radix_block_the_score_blocks_do_not_tile(device):
    case = _case(device, ties=False)
    b, hkv = case[0].shape[0], case[2].shape[1]
    k = torch.tensor([37, 20], dtype=torch.int32, device=device)
    keys = torch.zeros(b, hkv, N_MAX, dtype=torch.uint16, device=device)
    ws = workspace(b * hkv, device, blocks16(N_MAX, RBLOCK))
    with pytest.raises(ValueError, match="multiple of block"):
        dense_dot8(*case, k, k, k, keys, ws, block=BLOCK, guess=guess_state(b, hkv, device), radix_block=96)
