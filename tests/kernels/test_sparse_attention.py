"""Split-K sparse/dense decode attention against float64 references."""

import pytest
import torch
import torch.nn.functional as F

from ctxcache.kernels.split_k_attention import (choose_splits, merge_partials, partial_workspace, sparse_attention_ref,
                                               sparse_decode_attention)

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}  # relative L2 error


def _rel(out, ref):
    assert not torch.isnan(out).any()
    return ((out.double() - ref).norm() / ref.norm()).item()


def _inputs(b, hq, hkv, s, d, dtype, device):
    q = torch.randn(b, hq, d, dtype=dtype, device=device)
    k = torch.randn(b, hkv, s, d, dtype=dtype, device=device)
    v = torch.randn(b, hkv, s, d, dtype=dtype, device=device)
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 4])
def test_sparse_matches_reference(device, dtype, splits):
    b, hq, hkv, s, d = 2, 6, 2, 333, 32
    q, k, v = _inputs(b, hq, hkv, s, d, dtype, device)
    n = torch.tensor([321, 97], dtype=torch.int32, device=device)
    idx = torch.stack([torch.stack([torch.randperm(60)[:41] + 4 for _ in range(hkv)]) for _ in range(b)])
    idx = idx.int().to(device)
    k_sel = torch.tensor([41, 23], dtype=torch.int32, device=device)
    out = torch.full_like(q, float("nan"))
    sparse_decode_attention(q, k, v, n, idx, k_sel, sinks=4, recent=16, splits=splits, out=out, block_n=16)
    ref = sparse_attention_ref(q.double(), k.double(), v.double(), idx.cpu(), k_sel.cpu(), n.cpu(), 4, 16)
    assert _rel(out, ref.to(device)) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_matches_sdpa(device, dtype):
    b, hq, hkv, s, d = 2, 8, 2, 400, 64
    q, k, v = _inputs(b, hq, hkv, s, d, dtype, device)
    n = torch.tensor([400, 131], dtype=torch.int32, device=device)
    out = sparse_decode_attention(q, k, v, n, splits=8, block_n=32)
    ref = torch.stack([F.scaled_dot_product_attention(
        q[i, :, None].double(), k[i, :, :int(n[i])].double(), v[i, :, :int(n[i])].double(),
        enable_gqa=True)[:, 0] for i in range(b)])
    assert _rel(out, ref) < TOL[dtype]


def test_rejects_bad_idx_dtype(device):
    q, k, v = _inputs(1, 4, 2, 64, 32, torch.float32, device)
    n = torch.tensor([64], dtype=torch.int32, device=device)
    idx = torch.zeros(1, 2, 8, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="int32"):
        sparse_decode_attention(q, k, v, n, idx, torch.tensor([8], dtype=torch.int32, device=device))


def test_choose_splits_is_power_of_two():
    for rows, keys in ((8, 131072), (64, 6600), (8, 100)):
        s = choose_splits(rows, keys)
        assert s >= 1 and s & (s - 1) == 0 and (s == 1 or keys // s >= 128)


def test_merge_of_the_left_partials_equals_the_attention(device):
    """The partials the attention leaves in ws merge (merge_partials, as the offload attention
    uses it) into the same output (the padding query-head rows are never stored)."""
    b, hq, hkv, s, d = 2, 6, 2, 333, 32
    q, k, v = _inputs(b, hq, hkv, s, d, torch.float32, device)
    n = torch.tensor([321, 97], dtype=torch.int32, device=device)
    idx = torch.stack([torch.randperm(60)[:41] + 4 for _ in range(b * hkv)]).view(b, hkv, 41).int().to(device)
    k_sel = torch.tensor([41, 23], dtype=torch.int32, device=device)
    ws = partial_workspace(b, hq, hkv, 4, d, device)
    whole = sparse_decode_attention(q, k, v, n, idx, k_sel, 4, 16, splits=4, block_n=16, ws=ws)
    out = torch.full_like(q, float("nan"))
    torch.testing.assert_close(merge_partials(ws, out, hkv, 4), whole)
