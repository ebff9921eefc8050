"""The fused dense pipeline: dense_keys (route + 16-bit keys + block counts) and select16
(exact Top-K in one launch) against their torch references, and the fused split-K merge."""

import pytest
import torch
import torch.nn.functional as F

from ctxcache.kernels.dense_keys import block_counts_ref, dense_keys, dense_keys_ref
from ctxcache.methods.int8_tables import quantize_rows
from ctxcache.kernels.route import route
from ctxcache.kernels.select16 import BINS, HEAD, select16, select16_ref, workspace16
from ctxcache.kernels.sparse_attention import sparse_attention_ref, sparse_decode_attention
from ctxcache.kernels.topk import key16_codes, topk16_ref


def _tables(device, b=2, hkv=2, g=3, m=4, c=13, db=8, n=700, shared=False, int8=False):
    """Awkward sizes: a group of 3, C and N not powers of two, row 1 shorter with no streamed keys."""
    q = torch.randn(b, hkv * g, m * db)
    cent = F.normalize(torch.randn(1 if shared else b, hkv, m, c, db), dim=-1).half()
    dense = torch.randn(1 if shared else b, hkv, m, c, n).half()
    if shared:  # one table for every row (stride 0), as the e2e bench shares buffers
        cent, dense = cent.expand(b, -1, -1, -1, -1), dense.expand(b, -1, -1, -1, -1)
    scale = None
    if int8:
        dense, scale = quantize_rows(dense)
    new = torch.randn(b, hkv, m, c, 6)
    n_ctx = torch.tensor([n, n - 100], dtype=torch.int32)[:b]
    count = torch.tensor([4, 0], dtype=torch.int32)[:b]
    out = [q, cent, dense, scale, new, n_ctx, n_ctx.clone(), count]
    return [x.to(device) if x is not None else None for x in out]


def _limits(device, n_ctx, count, k):
    lo = torch.full((n_ctx.shape[0],), 4, dtype=torch.int32, device=device)
    return lo, (n_ctx + count - 2).int(), torch.tensor(k, dtype=torch.int32, device=device)


def _values(codes: torch.Tensor) -> torch.Tensor:
    """fp16 scores back from order-preserving key codes."""
    bits = torch.where(codes >= 0x8000, codes ^ 0x8000, codes ^ 0xFFFF)
    return bits.to(torch.int16).view(torch.float16).float()


@pytest.mark.parametrize("fuse_route,unit,shared,int8", [(True, False, False, False), (False, False, True, False),
                                                         (True, True, True, False), (True, False, False, True)])
def test_dense_keys_match_reference(device, fuse_route, unit, shared, int8):
    q, cent, dense, scale, new, n_ctx, start, count = _tables(device, shared=shared, int8=int8)
    lo, hi, k = _limits(device, n_ctx, count, [37, 20])
    b, hkv, block, n_pad = q.shape[0], dense.shape[1], 128, 768
    keys = torch.full((b, hkv, n_pad), 7, dtype=torch.int16, device=device).view(torch.uint16)  # poisoned
    ws = workspace16(b * hkv, n_pad, block, device)
    ws[:, HEAD:] = -1  # every block's counts must be written
    routed = None
    if not fuse_route:
        routed = route(q, cent, group=True)
    dense_keys(q, cent, dense, scale, new, n_ctx, start, count, lo, hi, k, keys, ws, block=block, routed=routed,
               unit_weights=unit, num_warps=4)
    want = dense_keys_ref(q, cent, dense, scale, new, n_ctx, start, count, n_pad, unit_weights=unit)
    got = key16_codes(keys)
    # fp32 sums in another order may round to a neighbouring fp16 value
    torch.testing.assert_close(_values(got), _values(want), rtol=2e-3, atol=2e-3)
    assert (got == want).float().mean() > 0.99
    hist0, ge = block_counts_ref(got, lo, hi, k, block)
    assert torch.equal(ws[:, :BINS], hist0)
    assert torch.equal(ws[:, HEAD:].view(b * hkv, -1, BINS), ge)
    assert int(ws[:, BINS:HEAD].abs().sum()) == 0  # hist1 and the counter untouched


def _run_select(device, codes, lo, hi, k, producer_block, block):
    """Producer statistics from the reference, then select16 -> per-row selections."""
    b, hkv, n_pad = codes.shape
    ws = workspace16(b * hkv, n_pad, producer_block, device)
    hist0, ge = block_counts_ref(codes, lo, hi, k, producer_block)
    ws[:, :BINS] = hist0
    ws[:, HEAD:] = ge.view(b * hkv, -1)
    cand = torch.zeros(b, hkv, n_pad, dtype=torch.int32, device=device)
    out = torch.full((b, hkv, int(k.max()) + 3), -7, dtype=torch.int32, device=device)
    keys = codes.to(torch.int16).view(torch.uint16)  # codes >= 2^15 wrap, bits kept
    select16(keys, lo, hi, k, ws, cand, out, producer_block, block=block)
    return out, ws


@pytest.mark.parametrize("levels", [65536, 300, 3])  # 3 levels: almost every key ties
@pytest.mark.parametrize("producer_block,block", [(64, 64), (64, 256), (128, 512)])
def test_select16_matches_reference(device, levels, producer_block, block):
    b, hkv, n_pad = 3, 2, 1024
    base = torch.randint(0, 1 << 16, (levels,))
    codes = base[torch.randint(0, levels, (b, hkv, n_pad))].int().to(device)
    lo = torch.tensor([4, 0, 10], dtype=torch.int32, device=device)
    hi = torch.tensor([990, 1024, 11], dtype=torch.int32, device=device)
    k = torch.tensor([49, 1024, 1], dtype=torch.int32, device=device)  # row 1 takes every key
    out, ws = _run_select(device, codes, lo, hi, k, producer_block, block)
    flat = codes.view(b * hkv, n_pad)
    want = select16_ref(flat, lo, hi, k)
    for r in range(b * hkv):
        kr = int(k[r // hkv])
        got = out.view(b * hkv, -1)[r]
        assert torch.equal(got[:kr], want[r]), r  # the exact set, in select16's order
        assert bool((got[kr:] == -7).all())  # nothing written past k
        one = slice(r // hkv, r // hkv + 1)
        assert torch.equal(got[:kr].sort().values, topk16_ref(flat[r:r + 1], lo[one], hi[one], k[one])[0])
    assert int(ws[:, :HEAD].abs().sum()) == 0  # histograms and counters left zeroed for the next call


def test_select16_empty_budget_and_repeat(device):
    """k = 0 selects nothing; a second call on a reused workspace gives the same answer."""
    codes = torch.randint(0, 1 << 16, (2, 1, 512), dtype=torch.int32, device=device)
    lo = torch.zeros(2, dtype=torch.int32, device=device)
    hi = torch.full((2,), 512, dtype=torch.int32, device=device)
    k = torch.tensor([0, 17], dtype=torch.int32, device=device)
    first, _ = _run_select(device, codes, lo, hi, k, 128, 256)
    again, _ = _run_select(device, codes, lo, hi, k, 128, 256)
    assert bool((first[0] == -7).all()) and torch.equal(first, again)


def test_select16_rejects_bad_shapes(device):
    keys = torch.zeros(1, 2, 1000, dtype=torch.int16, device=device).view(torch.uint16)
    lo = hi = k = torch.zeros(1, dtype=torch.int32, device=device)
    ws = torch.zeros(2, HEAD, dtype=torch.int32, device=device)
    cand = torch.zeros(1, 2, 1000, dtype=torch.int32, device=device)
    out = torch.zeros(1, 2, 8, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="multiple of the producer block"):
        select16(keys, lo, hi, k, ws, cand, out, 128, block=256)
    with pytest.raises(ValueError, match="power of two|must be workspace16"):
        select16(keys[..., :768], lo, hi, k, ws, cand[..., :768], out, 128, block=256)


@pytest.mark.parametrize("splits", [1, 4])
def test_fused_merge_matches_reference(device, splits):
    b, hkv, g, d, s = 2, 2, 3, 32, 300
    q = torch.randn(b, hkv * g, d, device=device)
    kc, vc = torch.randn(b, hkv, s, d, device=device), torch.randn(b, hkv, s, d, device=device)
    n = torch.tensor([300, 97], dtype=torch.int32, device=device)
    k_sel = torch.tensor([40, 9], dtype=torch.int32, device=device)
    idx = torch.stack([torch.randperm(200, device=device)[:40] + 4 for _ in range(b * hkv)]).view(b, hkv, 40).int()
    idx[1] = idx[1].clamp(max=60)
    counter = torch.zeros(b * hkv, dtype=torch.int32, device=device)
    for _ in range(2):  # the counter resets itself: a replay merges again
        out = sparse_decode_attention(q, kc, vc, n, idx, k_sel, 4, 8, splits=splits, block_n=16, merge_counter=counter)
        want = sparse_attention_ref(q, kc, vc, idx, k_sel, n, 4, 8)
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
        assert int(counter.abs().sum()) == 0
