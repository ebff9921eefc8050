"""The packed prefill's spans by one Triton launch (kernels/span_attention.py) equal the outputs
and log-sum-exps of the path they replace (packed_attention.attend_with_lse, fp32 math here), and the packed attention that uses them equals SDPA; on
the CPU through TRITON_INTERPRET."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from ctxcache.kernels import span_attention as sa
from ctxcache.models import packed_attention
from ctxcache.models.packed_attention import attend_with_lse

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _reference(rows, k, v):
    """attend_with_lse over the rows expanded to every span, in fp32 math."""
    out, lse = attend_with_lse(rows.float()[None].expand(k.shape[0], -1, -1, -1), k.float(), v.float())
    return out.to(rows.dtype), lse


@pytest.mark.parametrize("hkv,r,spans,length,dtype", [
    (2, 20, 3, 100, torch.float32), (1, sa.BLOCK_M + 3, 1, sa.BLOCK_N, torch.float32),
    (2, 8, 2, 1, torch.float32), (2, 64, 4, 130, torch.bfloat16)])
def test_spans_equal_the_reference(hkv, r, spans, length, dtype):
    g = torch.Generator().manual_seed(r + length)
    rows = (torch.randn(hkv, r, 32, generator=g) * 2).to(DEVICE, dtype)
    # the context's keys cut into spans as packed_attention cuts a cache row: strided views
    kv = torch.randn(2, hkv, spans * length + 7, 32, generator=g).to(DEVICE, dtype)
    k, v = (x[:, :spans * length].unflatten(1, (spans, length)).transpose(0, 1) for x in kv)
    out, lse = sa.span_attention(rows, k, v)
    want_out, want_lse = _reference(rows, k, v)
    assert out.dtype == dtype and out.shape == (spans, hkv, r, 32) and lse.shape == (spans, hkv, r)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), want_out.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(lse, want_lse, rtol=tol, atol=tol)


def test_the_packed_attention_through_the_span_kernel_equals_sdpa(monkeypatch):
    monkeypatch.setattr(packed_attention, "SPAN_KERNEL", True)
    called = []
    monkeypatch.setattr(sa, "span_attention", lambda *a: called.append(1) or _reference(*a))
    q = torch.randn(1, 8, 5, 32, device=DEVICE)
    k, v = torch.randn(2, 1, 2, 1300, 32, device=DEVICE)
    got = packed_attention.packed_appended_attention(q, k, v, 3)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(5, 1300), enable_gqa=True)
    assert called == [1]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bad_shapes_are_one_clear_error():
    with pytest.raises(ValueError, match="disagree"):
        sa.span_attention(torch.zeros(2, 4, 32), torch.zeros(1, 3, 10, 32), torch.zeros(1, 3, 10, 32))
