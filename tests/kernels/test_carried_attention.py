"""reselect's attention (kernels/carried_attention.py): a carried row attends all its re-rank
candidates (less the -1 padding), the others their selection, as the per-row torch reference
does; on a lean step the re-rank ranks the candidates from the attention's own logits and
partials and keeps what rerank_ref keeps (fp32: exactly)."""

import pytest
import torch

from ctxcache.kernels.carried_attention import carried_attention, carried_attention_ref
from ctxcache.kernels.rerank import Reranker, rerank_ref
from ctxcache.kernels.split_k_attention import partial_workspace


def _batch(gen: torch.Generator, dtype: torch.dtype, carried: list[int]):
    b, hkv, g, d, max_len, sinks, recent = 3, 2, 4, 16, 400, 4, 8
    q = torch.randn(b, hkv * g, d, generator=gen).to(dtype)
    keys = torch.randn(b, hkv, max_len, d, generator=gen).to(dtype)
    values = torch.randn(b, hkv, max_len, d, generator=gen).to(dtype)
    n = torch.tensor([400, 233, 61], dtype=torch.int32)
    lo = torch.clamp(n, max=sinks)
    hi = torch.maximum(lo, n - recent)
    k = torch.minimum(torch.ceil(n * 0.1).int(), hi - lo)
    kc = torch.minimum(hi - lo, k + 20).int()
    idx = torch.full((b, hkv, int(k.max()) + 3), 5, dtype=torch.int32)
    cand = torch.full((b, hkv, int(kc.max()) + 3), 9, dtype=torch.int32)  # junk past kc (never read)
    for r in range(b):
        for h in range(hkv):
            region = int(lo[r]) + torch.randperm(int(hi[r] - lo[r]), generator=gen)
            idx[r, h, :int(k[r])] = region[:int(k[r])].int()
            real = int(kc[r]) - 7 * h  # head 1 ends in 7 slots of padding
            cand[r, h, :int(kc[r])] = -1
            cand[r, h, :real] = region[:real].int()
    return q, keys, values, n, lo, hi, k, idx, kc, cand, torch.tensor(carried, dtype=torch.int32), sinks, recent


def _run(device, q, keys, values, n, idx, k, cand, kc, carried, sinks, recent, splits, logits=None):
    ws = partial_workspace(q.shape[0], q.shape[1], keys.shape[1], splits, q.shape[2], device)
    args = [t.to(device) for t in (q, keys, values, n, idx, k, cand, kc, carried)]
    return carried_attention(*args, sinks, recent, splits, ws, logits=logits, block_n=16), ws


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 4])
def test_carried_rows_attend_their_candidates_the_others_their_selection(device, dtype, splits):
    q, keys, values, n, lo, hi, k, idx, kc, cand, carried, sinks, recent = _batch(
        torch.Generator().manual_seed(0), dtype, [1, 0, 1])
    got, _ = _run(device, q, keys, values, n, idx, k, cand, kc, carried, sinks, recent, splits)
    want = carried_attention_ref(q.float(), keys.float(), values.float(), idx, k, cand, kc, carried, n, sinks, recent)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float().cpu(), want, atol=tol, rtol=tol)
    selected_only = carried_attention_ref(q.float(), keys.float(), values.float(), idx, k, cand, kc,
                                          torch.zeros(3, dtype=torch.int32), n, sinks, recent)
    assert (selected_only[0] - want[0]).abs().max() > 0.1  # the carried row did read its candidates


@pytest.mark.parametrize("splits", [1, 4])
def test_a_lean_steps_rank_from_the_attentions_logits_keeps_the_reference_keys(device, splits):
    q, keys, values, n, lo, hi, k, idx, kc, cand, carried, sinks, recent = _batch(
        torch.Generator().manual_seed(1), torch.float32, [1, 1, 1])
    b, hkv, g = q.shape[0], keys.shape[1], q.shape[1] // keys.shape[1]
    kc_max, k_max = int(kc.max()), int(k.max())
    rr = Reranker(b, hkv, g, kc_max, k_max, device, programs=12)
    rr.logits.fill_(1e4)  # stale logits of an earlier layer must not survive
    _, ws = _run(device, q, keys, values, n, idx, k, cand, kc, carried, sinks, recent, splits, rr.logits)
    dev = [t.to(device) for t in (cand, kc, k)]
    got = rr.rank(torch.float32, *dev, ws[1], splits, True).cpu()
    want = rerank_ref(q, keys, cand, kc, lo.int(), hi.int(), n, k_max, sinks, recent)
    for r in range(b):
        for h in range(hkv):
            kr = int(k[r])
            assert set(got[r, h, :kr].tolist()) == set(want[r, h, :kr].tolist()), (r, h)
