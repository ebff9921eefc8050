"""The GPU path's exact re-rank picks the keys its reference, CSAttention's exact_rerank, picks
for every row of a batch with different lengths: the Triton kernels (Reranker, interpreted on
CPU) and the batched torch reference (rerank_ref)."""

import pytest
import torch

from ctxcache.kernels.rerank import Reranker, rerank_ref
from ctxcache.methods.csattention import exact_rerank


def _rows(gen: torch.Generator, dtype: torch.dtype):
    b, hkv, g, d, max_len, sinks, recent = 3, 2, 4, 16, 300, 4, 8
    q = torch.randn(b, hkv * g, d, generator=gen).to(dtype)
    keys = torch.randn(b, hkv, max_len, d, generator=gen).to(dtype)
    n = torch.tensor([300, 150, 61])
    lo = torch.clamp(n, max=sinks)
    hi = torch.maximum(lo, n - recent)
    k = torch.minimum(torch.ceil(n * 0.1).long(), hi - lo)
    kc = torch.minimum(hi - lo, 4 * k)
    cand = torch.zeros(b, hkv, int(kc.max()) + 5, dtype=torch.int32)
    for r in range(b):  # distinct candidates in the region, then junk past kc[r] (never read)
        for h in range(hkv):
            perm = int(lo[r]) + torch.randperm(int(hi[r] - lo[r]), generator=gen)[:int(kc[r])]
            cand[r, h, :int(kc[r])] = perm.int()
            cand[r, h, int(kc[r]):] = 7
    return q, keys, cand, n, lo, hi, k, kc, sinks, recent


def _run(impl: str, device, q, keys, cand, n, lo, hi, k, kc, sinks, recent) -> torch.Tensor:
    dev = [t.to(device) for t in (q, keys, cand)] + [t.int().to(device) for t in (kc, k, lo, hi, n)]
    qd, kd, cd, kcd, kd32, lod, hid, nd = dev
    kc_max, k_max = cand.shape[2] - 5, int(k.max())
    if impl == "torch":
        return rerank_ref(qd, kd, cd, kcd, lod, hid, nd, k_max, sinks, recent).cpu()
    rr = Reranker(q.shape[0], keys.shape[1], q.shape[1] // keys.shape[1], kc_max, k_max, device, programs=12)
    return rr(qd, kd, cd, kcd, kd32, lod, hid, nd, sinks, recent).cpu()


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_batched_rerank_equals_the_reference_per_row(device, impl):
    rows = _rows(torch.Generator().manual_seed(0), torch.float32)
    q, keys, cand, n, lo, hi, k, kc, sinks, recent = rows
    got = _run(impl, device, *rows)
    for r in range(q.shape[0]):
        nr = int(n[r])
        others = torch.cat([torch.arange(int(lo[r])), torch.arange(int(hi[r]), nr)]).expand(keys.shape[1], -1)
        want = exact_rerank(q[r], keys[r, :, :nr], cand[r, :, :int(kc[r])].long(), int(k[r]), others)
        for h in range(keys.shape[1]):
            assert set(got[r, h, :int(k[r])].tolist()) == set(want[h].tolist()), (impl, r, h)


def test_the_kernel_ranks_bf16_keys_as_the_reference(device):
    """bf16 inputs (the model's): the MMA's order of summation may swap near-ties only."""
    rows = _rows(torch.Generator().manual_seed(1), torch.bfloat16)
    q, keys, cand, n, lo, hi, k, kc, sinks, recent = rows
    got, want = _run("triton", device, *rows), _run("torch", device, *rows)
    for r in range(q.shape[0]):
        for h in range(keys.shape[1]):
            same = set(got[r, h, :int(k[r])].tolist()) & set(want[r, h, :int(k[r])].tolist())
            assert len(same) >= int(k[r]) - 1, (r, h)
