"""The GPU path's exact re-rank (batched torch, graph-capturable) picks the keys its reference,
CSAttention's exact_rerank, picks for every row of a batch with different lengths."""

import torch

from ctxcache.decoder.gpu.attention import rerank_candidates
from ctxcache.methods.csattention import exact_rerank


def test_batched_rerank_equals_the_reference_per_row(device):
    gen = torch.Generator().manual_seed(0)
    b, hkv, g, d, max_len, sinks, recent = 3, 2, 4, 16, 300, 4, 8
    q, keys = torch.randn(b, hkv * g, d, generator=gen), torch.randn(b, hkv, max_len, d, generator=gen)
    n = torch.tensor([300, 150, 61])
    lo = torch.clamp(n, max=sinks)
    hi = torch.maximum(lo, n - recent)
    k = torch.minimum(torch.ceil(n * 0.1).long(), hi - lo)
    kc = torch.minimum(hi - lo, 4 * k)
    kc_max, k_max = int(kc.max()) + 5, int(k.max())
    cand = torch.zeros(b, hkv, kc_max, dtype=torch.int32)
    for r in range(b):  # distinct candidates in the region, then junk past kc[r] (never read)
        for h in range(hkv):
            perm = int(lo[r]) + torch.randperm(int(hi[r] - lo[r]), generator=gen)[:int(kc[r])]
            cand[r, h, :int(kc[r])] = perm.int()
            cand[r, h, int(kc[r]):] = 7
    got = rerank_candidates(q.to(device), keys.to(device), cand.to(device), kc.int().to(device), lo.int().to(device),
                            hi.int().to(device), n.int().to(device), k_max, sinks, recent).cpu()
    for r in range(b):
        nr = int(n[r])
        others = torch.cat([torch.arange(int(lo[r])), torch.arange(int(hi[r]), nr)]).expand(hkv, -1)
        want = exact_rerank(q[r], keys[r, :, :nr], cand[r, :, :int(kc[r])].long(), int(k[r]), others)
        for h in range(hkv):
            assert set(got[r, h, :int(k[r])].tolist()) == set(want[h].tolist()), (r, h)
