"""bench/pass0_attention_probe's kernel (attention over radix pass 0's definite winners) against its torch reference."""

import torch

from ctxcache.bench.pass0_attention_probe import (definite_winners_ref, kth_key_ref, pass0_attention,
                                                   pass0_attention_ref, threshold_winners_ref)
from ctxcache.kernels.topk import workspace

from test_select_kernels import as_u16


def test_pass0_attention_matches_reference(device):
    b, hkv, hq, d, n_pad, block = 2, 2, 8, 16, 512, 128
    lo = torch.tensor([4, 4], dtype=torch.int32)
    hi = torch.tensor([480, 500], dtype=torch.int32)
    k = torch.tensor([25, 40], dtype=torch.int32)
    codes = torch.randint(0, 1 << 16, (b, hkv, n_pad), dtype=torch.int32)
    ws = workspace(b * hkv, "cpu", n_pad // block)
    for r in range(b * hkv):  # radix pass 0 as the score kernel leaves it: top bytes in [lo, hi)
        bb = r // hkv
        ws[r, :256] = torch.bincount(codes.view(-1, n_pad)[r, lo[bb]:hi[bb]] >> 8, minlength=256).int()
    q = torch.randn(b, hq, d)
    kc, vc = torch.randn(b, hkv, n_pad, d), torch.randn(b, hkv, n_pad, d)
    win = definite_winners_ref(codes.view(-1, n_pad), lo.repeat_interleave(hkv), hi.repeat_interleave(hkv),
                               k.repeat_interleave(hkv))
    assert all(0 < w.numel() < 40 for w in win)  # winners exist and fewer than k: ties are left out
    dev = [t.to(device) for t in (q, kc, vc, as_u16(codes), lo, hi, k, ws)]
    got = pass0_attention(*dev, block=block, block_n=16)
    want = pass0_attention_ref(q, kc, vc, codes, lo, hi, k)
    torch.testing.assert_close(got.float().cpu(), want, atol=1e-4, rtol=1e-4)


def test_pass0_attention_with_ties_is_the_exact_top_k_attention(device):
    b, hkv, hq, d, n_pad, block = 2, 2, 8, 16, 512, 128
    lo = torch.tensor([4, 4], dtype=torch.int32)
    hi = torch.tensor([480, 500], dtype=torch.int32)
    k = torch.tensor([25, 40], dtype=torch.int32)
    codes = torch.randint(0, 1 << 9, (b, hkv, n_pad), dtype=torch.int32) * 128  # few values: ties at the threshold
    ws = workspace(b * hkv, "cpu", n_pad // block)
    for r in range(b * hkv):
        bb = r // hkv
        ws[r, :256] = torch.bincount(codes.view(-1, n_pad)[r, lo[bb]:hi[bb]] >> 8, minlength=256).int()
    q = torch.randn(b, hq, d)
    kc, vc = torch.randn(b, hkv, n_pad, d), torch.randn(b, hkv, n_pad, d)
    dev = [t.to(device) for t in (q, kc, vc, as_u16(codes), lo, hi, k, ws)]
    got = pass0_attention(*dev, block=block, block_n=16, ties=True)
    want = pass0_attention_ref(q, kc, vc, codes, lo, hi, k, ties=True)
    torch.testing.assert_close(got.float().cpu(), want, atol=1e-4, rtol=1e-4)


def test_known_threshold_attention_takes_every_key_at_or_above_it(device):
    b, hkv, hq, d, n_pad, block = 2, 2, 8, 16, 512, 128
    lo = torch.tensor([4, 4], dtype=torch.int32)
    hi = torch.tensor([480, 500], dtype=torch.int32)
    k = torch.tensor([25, 40], dtype=torch.int32)
    codes = torch.randint(0, 1 << 6, (b, hkv, n_pad), dtype=torch.int32) * 1024  # ties at the threshold
    rep = [t.repeat_interleave(hkv) for t in (lo, hi, k)]
    thr = kth_key_ref(codes.view(-1, n_pad), *rep)
    taken = threshold_winners_ref(codes.view(-1, n_pad), thr, *rep[:2])
    # every tie at the threshold is taken: at least k per row, more where the k-th key has ties
    assert all(w.numel() >= int(kk) for w, kk in zip(taken, rep[2]))
    assert any(w.numel() > int(kk) for w, kk in zip(taken, rep[2]))
    ws = workspace(b * hkv, "cpu", n_pad // block)
    q = torch.randn(b, hq, d)
    kc, vc = torch.randn(b, hkv, n_pad, d), torch.randn(b, hkv, n_pad, d)
    dev = [t.to(device) for t in (q, kc, vc, as_u16(codes), lo, hi, k, ws)]
    got = pass0_attention(*dev, block=block, block_n=16, thresh=thr.to(device))
    want = pass0_attention_ref(q, kc, vc, codes, lo, hi, k, thresh=thr)
    torch.testing.assert_close(got.float().cpu(), want, atol=1e-4, rtol=1e-4)
