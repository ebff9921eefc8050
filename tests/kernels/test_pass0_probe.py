"""bench/pass0_attention_probe's kernel (attention over radix pass 0's definite winners) against its torch reference."""

import torch

from ctxcache.bench.pass0_attention_probe import (definite_winners_ref, kth_key_ref, pass0_attention,
                                                   pass0_attention_ref, threshold_winners_ref)
from ctxcache.kernels.topk import workspace

from test_select_kernels import as_u16

B, HKV, HQ, D, N_PAD, BLOCK = 2, 2, 8, 16, 512, 128
LO = torch.tensor([4, 4], dtype=torch.int32)
HI = torch.tensor([480, 500], dtype=torch.int32)
K = torch.tensor([25, 40], dtype=torch.int32)


def _case(codes: torch.Tensor, device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(CPU inputs q, K, V, codes, lo, hi, k; the same on `device`, keys as uint16, then the
    workspace holding radix pass 0 as the score kernel leaves it: top bytes in [lo, hi))."""
    ws = workspace(B * HKV, "cpu", N_PAD // BLOCK)
    for r in range(B * HKV):
        bb = r // HKV
        ws[r, :256] = torch.bincount(codes.view(-1, N_PAD)[r, LO[bb]:HI[bb]] >> 8, minlength=256).int()
    q = torch.randn(B, HQ, D)
    kc, vc = torch.randn(B, HKV, N_PAD, D), torch.randn(B, HKV, N_PAD, D)
    dev = [t.to(device) for t in (q, kc, vc, as_u16(codes), LO, HI, K, ws)]
    return [q, kc, vc, codes, LO, HI, K], dev


def _per_row(*t: torch.Tensor) -> list[torch.Tensor]:
    return [x.repeat_interleave(HKV) for x in t]


def test_pass0_attention_matches_reference(device):
    codes = torch.randint(0, 1 << 16, (B, HKV, N_PAD), dtype=torch.int32)
    cpu, dev = _case(codes, device)
    win = definite_winners_ref(codes.view(-1, N_PAD), *_per_row(LO, HI, K))
    assert all(0 < w.numel() < 40 for w in win)  # winners exist and fewer than k: ties are left out
    got = pass0_attention(*dev, block=BLOCK, block_n=16)
    torch.testing.assert_close(got.float().cpu(), pass0_attention_ref(*cpu), atol=1e-4, rtol=1e-4)


def test_pass0_attention_with_ties_is_the_exact_top_k_attention(device):
    codes = torch.randint(0, 1 << 9, (B, HKV, N_PAD), dtype=torch.int32) * 128  # few values: ties at the threshold
    cpu, dev = _case(codes, device)
    got = pass0_attention(*dev, block=BLOCK, block_n=16, ties=True)
    torch.testing.assert_close(got.float().cpu(), pass0_attention_ref(*cpu, ties=True), atol=1e-4, rtol=1e-4)


def test_known_threshold_attention_takes_every_key_at_or_above_it(device):
    codes = torch.randint(0, 1 << 6, (B, HKV, N_PAD), dtype=torch.int32) * 1024  # ties at the threshold
    rows = _per_row(LO, HI, K)
    thr = kth_key_ref(codes.view(-1, N_PAD), *rows)
    taken = threshold_winners_ref(codes.view(-1, N_PAD), thr, *rows[:2])
    # every tie at the threshold is taken: at least k per row, more where the k-th key has ties
    assert all(w.numel() >= int(kk) for w, kk in zip(taken, rows[2]))
    assert any(w.numel() > int(kk) for w, kk in zip(taken, rows[2]))
    cpu, dev = _case(codes, device)
    got = pass0_attention(*dev, block=BLOCK, block_n=16, thresh=thr.to(device))
    torch.testing.assert_close(got.float().cpu(), pass0_attention_ref(*cpu, thresh=thr), atol=1e-4, rtol=1e-4)
