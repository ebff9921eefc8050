"""radix_topk_pair: two Top-Ks of the same 16-bit keys (ties to the lowest index, as
topk16_ref), each chosen index written as the value the mapping gives it, the second output's
tail -1; on CPU through the Triton interpreter, on the GPU where there is one."""

import pytest
import torch

from ctxcache.kernels.topk import blocks16, key16_codes, topk16_ref, workspace
from ctxcache.kernels.topk_pair import radix_topk_pair


def _case(gen: torch.Generator, device, n: int = 1000, b: int = 3, hkv: int = 2, f: int = 24):
    # few distinct values: many ties at every threshold
    codes = torch.randint(0, 40, (b, hkv, n), generator=gen) * 1500
    keys = codes.to(torch.int32).to(torch.int16).view(torch.uint16)
    lo = torch.tensor([0, 5, 300], dtype=torch.int32)
    hi = torch.tensor([n, 700, 301], dtype=torch.int32)
    k = torch.tensor([200, 77, 1], dtype=torch.int32)
    k2 = torch.tensor([20, 0, 1], dtype=torch.int32)
    mapping = torch.randint(0, 1 << 30, (b, hkv, n + 3), generator=gen, dtype=torch.int32)
    return [t.to(device) for t in (keys, lo, hi, k, k2, mapping)], f


def _want(keys, lo, hi, k, mapping) -> list[set[int]]:
    rows = key16_codes(keys.cpu()).view(-1, keys.shape[2])
    b, hkv = keys.shape[:2]
    rep = lambda t: t.cpu().repeat_interleave(hkv)  # noqa: E731
    idx = topk16_ref(rows, rep(lo), rep(hi), rep(k))
    flat = mapping.cpu().view(-1, mapping.shape[2])
    return [set(flat[r, i].tolist()) for r, i in enumerate(idx)]


@pytest.mark.parametrize("block", [256, 512])
def test_both_selections_map_the_reference_top_k(device, block):
    (keys, lo, hi, k, k2, mapping), f = _case(torch.Generator().manual_seed(3), device)
    b, hkv, n = keys.shape
    ws = workspace(2 * b * hkv, device, blocks16(n, block))
    out = torch.full((b, hkv, int(k.max())), -7, dtype=torch.int32, device=device)
    out2 = torch.full((b, hkv, f), -7, dtype=torch.int32, device=device)
    radix_topk_pair(keys, lo, hi, k, out, ws[:b * hkv], mapping, k2, out2, ws[b * hkv:], block=block,
                    hist0_done=False)
    want, want2 = _want(keys, lo, hi, k, mapping), _want(keys, lo, hi, k2, mapping)
    kk, kk2 = k.cpu().repeat_interleave(hkv), k2.cpu().repeat_interleave(hkv)
    got, got2 = out.cpu().view(b * hkv, -1), out2.cpu().view(b * hkv, -1)
    for r in range(b * hkv):
        assert sorted(got[r, :kk[r]].tolist()) == sorted(want[r]), r
        assert sorted(got2[r, :kk2[r]].tolist()) == sorted(want2[r]), r
        assert (got2[r, kk2[r]:] == -1).all(), r  # follow's "none"
        assert (got[r, kk[r]:] == -7).all(), r  # the rest of out is left as is


def test_one_selection_alone(device):
    (keys, lo, hi, k, _, mapping), _ = _case(torch.Generator().manual_seed(4), device)
    b, hkv, n = keys.shape
    out = torch.zeros(b, hkv, int(k.max()), dtype=torch.int32, device=device)
    radix_topk_pair(keys, lo, hi, k, out, workspace(b * hkv, device, blocks16(n, 256)), mapping, block=256,
                    hist0_done=False)
    got, kk = out.cpu().view(b * hkv, -1), k.cpu().repeat_interleave(hkv)
    assert all(sorted(got[r, :kk[r]].tolist()) == sorted(w) for r, w in enumerate(_want(keys, lo, hi, k, mapping)))


def test_refuses_a_second_selection_without_its_buffers(device):
    (keys, lo, hi, k, k2, mapping), _ = _case(torch.Generator().manual_seed(5), device)
    b, hkv, n = keys.shape
    ws = workspace(b * hkv, device, blocks16(n, 256))
    with pytest.raises(ValueError, match="needs out2 and ws2"):
        radix_topk_pair(keys, lo, hi, k, torch.zeros(b, hkv, 200, dtype=torch.int32, device=device), ws, mapping,
                        k2, block=256)
