"""A load's GPU kernels against their torch references, bit for bit: int8 K/V decoded from host
memory into a cache view (kv_codec.decode_kv), and CSAttention's int8 rows (dense_rows)."""

import pytest
import torch

from ctxcache.host_copy import pinned_exact
from ctxcache.kernels.load_kernels import dequant_into, int8_rows, rows_ok
from ctxcache.kv_codec import decode_kv, encode_kv
from ctxcache.methods.csattention_rows import dense_rows


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                                               (torch.float16, torch.bfloat16)])  # the service's: fp16 K/V, bf16 model
@pytest.mark.parametrize("d", [64, 128])
def test_dequant_into_a_cache_view_equals_decode_kv(device, dtype, cache_dtype, d):
    hkv, n, max_len = 3, 301, 340  # n: not a multiple of the 128-token key group
    k, v = (torch.randn(hkv, n, d) * 3).to(dtype), torch.randn(hkv, n, d).to(dtype)
    k[0, 5, 7] = 40.0  # an outlier channel value: its group's scale differs
    parts = dict(encode_kv(k, v, "int8"))
    host = {}
    for name, t in parts.items():  # pinned where a GPU reads it over PCIe, as a load does
        host[name] = pinned_exact(tuple(t.shape), t.dtype)
        host[name].copy_(t)
    want_k, want_v = (t.to(cache_dtype) for t in decode_kv(parts, "int8", dtype))  # decoded, then copied
    cache = torch.full((2, hkv, max_len, d), float("nan"), dtype=cache_dtype, device=device)
    dequant_into(host["k"], host["k_scale"], cache[1, :, :n], 128, dtype)
    dequant_into(host["v"], host["v_scale"], cache[0, :, :n], 1, dtype)
    assert torch.equal(cache[1, :, :n].cpu(), want_k) and torch.equal(cache[0, :, :n].cpu(), want_v)
    assert cache[:, :, n:].isnan().all() and cache[1, :, :n].isfinite().all()  # nothing past n written


@pytest.mark.parametrize("kdtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,c,d", [(16, 16, 128), (16, 12, 64), (8, 16, 64)])
def test_int8_rows_equal_dense_rows(device, kdtype, m, c, d):
    hkv, n = 2, 333
    torch.manual_seed(m * c + d)
    keys = (torch.randn(hkv, n, d) * torch.logspace(-2, 1, d)).to(kdtype)  # channels of many scales
    cent = torch.randn(hkv, m, c, d // m).half()
    sub_k = keys.unflatten(-1, (m, -1)).permute(0, 2, 1, 3)  # the contiguous layout's view
    want = dense_rows(cent, sub_k, int8=True)
    dev_keys = torch.zeros(hkv, n + 40, d, dtype=kdtype, device=device)[:, 7:7 + n]  # a strided view
    dev_keys.copy_(keys)
    dev_sub = dev_keys.unflatten(-1, (m, -1)).permute(0, 2, 1, 3)
    assert rows_ok(cent, dev_sub)
    rows, scales = int8_rows(cent.to(device), dev_sub)
    assert torch.equal(scales.cpu(), want["dense_scale"])
    assert torch.equal(rows.cpu(), want["dense_score"])


def test_dequant_into_refuses_mismatched_shapes(device):
    codes = torch.zeros(2, 10, 64, dtype=torch.int8)
    with pytest.raises(ValueError, match="one shape"):
        dequant_into(codes, torch.ones(2, 1, 64, dtype=torch.float16), torch.zeros(2, 9, 64, device=device), 128)
