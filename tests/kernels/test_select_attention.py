"""The collect fused into the split-K attention against the torch reference (exact Top-K over
16-bit keys, ties to the lowest index, then attention over sinks + selection + recent)."""

import pytest
import torch

from ctxcache.kernels.select_attention import (select_attention, select_attention_ref, select_buffers,
                                               selected_indices)
from ctxcache.kernels.sparse_attention import region, sparse_decode_attention
from ctxcache.kernels.topk import blocks16, radix_topk, topk16_ref, workspace

from test_select_kernels import as_u16

TOL = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2}  # relative L2 error, as test_sparse_attention


def _case(device, dtype, ties: bool, n_max=1500, block=256, sinks=4, recent=16):
    """Two rows of different lengths, 2 KV heads of 3 query heads; keys with or without ties
    (ties: 7 distinct values, so the threshold's ties span many blocks)."""
    b, hq, hkv, d = 2, 6, 2, 32
    n = torch.tensor([n_max, 700], dtype=torch.int32)
    lo, hi = region(n, sinks, recent)
    k = torch.tensor([150, 61], dtype=torch.int32)
    codes = torch.randint(30000, 30007, (b, hkv, n_max)) if ties else torch.randint(0, 65536, (b, hkv, n_max))
    q = torch.randn(b, hq, d, dtype=dtype)
    kc, vc = torch.randn(2, b, hkv, n_max, d, dtype=dtype)
    ws = workspace(b * hkv, device, blocks16(n_max, block))
    keys = as_u16(codes).to(device)
    dev = [t.to(device) for t in (q, kc, vc, n, lo, hi, k)]
    # passes 0 and 1 into ws (the collect after them leaves both histograms as they are)
    idx = torch.zeros(b, hkv, int(k.max()), dtype=torch.int32, device=device)
    radix_topk(keys, dev[4], dev[5], dev[6], idx, ws, block=block)
    return dev, keys, codes, ws, idx, (q, kc, vc, n, lo, hi, k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ties", [False, True])
def test_select_attention_matches_reference(device, dtype, ties):
    (q, kc, vc, n, lo, hi, k), keys, codes, ws, idx, host = _case(device, dtype, ties)
    bufs = select_buffers(2, 6, 2, keys.shape[2], 256, 32, device)
    out = select_attention(q, kc, vc, n, keys, lo, hi, k, ws, 256, 4, 16, bufs=bufs, block_n=16)
    hq, hk, hv, hn, hlo, hhi, hkk = host
    ref = select_attention_ref(hq.double(), hk.double(), hv.double(), hn, codes, hlo, hhi, hkk, 4, 16)
    assert ((out.double().cpu() - ref).norm() / ref.norm()).item() < TOL[dtype]
    # the same keys as the collect and the reference (ties to the lowest index)
    got = selected_indices(*bufs[:2], int(hkk.max())).cpu()
    want = topk16_ref(codes.view(4, -1), hlo.repeat_interleave(2), hhi.repeat_interleave(2),
                      hkk.repeat_interleave(2))
    for r in range(4):
        kk = int(hkk[r // 2])
        assert torch.equal(got.view(4, -1)[r, :kk].long(), want[r])
        assert torch.equal(idx.view(4, -1)[r, :kk].sort().values.long().cpu(), want[r])


def test_select_attention_equals_collect_then_split(device):
    """Same output as the unfused step (collect -> split-K over idx) up to summation order."""
    (q, kc, vc, n, lo, hi, k), keys, _, ws, idx, _ = _case(device, torch.float32, ties=True)
    fused = select_attention(q, kc, vc, n, keys, lo, hi, k, ws, 256, 4, 16, block_n=32)
    split = sparse_decode_attention(q, kc, vc, n, idx, k, 4, 16, splits=4, block_n=32)
    assert torch.allclose(fused, split, rtol=1e-5, atol=1e-6)


def test_select_attention_rejects_mismatched_workspace(device):
    (q, kc, vc, n, lo, hi, k), keys, _, ws, _, _ = _case(device, torch.float32, ties=False)
    with pytest.raises(ValueError, match="ws"):
        select_attention(q, kc, vc, n, keys, lo, hi, k, ws[:, :100], 256, 4, 16)
    with pytest.raises(ValueError, match="uint16"):
        select_attention(q, kc, vc, n, keys.view(torch.int16), lo, hi, k, ws, 256, 4, 16)


def test_graph_decode_with_fused_collect_matches_reference_tokens(device):
    """GpuSparseAttention(fuse_collect) in the graph decode: the reference loop's greedy tokens."""
    from ctxcache.decoder.gpu.check import check_greedy

    got = check_greedy(device, steps=6, n_ctx=300, attn_cfg={"fuse_collect": True})
    assert got["identical"], got
