"""The packed prefill attention (each KV head's keys read once, the context cut into spans)
computes what lower-right causal SDPA over GQA (models.attention.appended_attention) computes;
on a GPU in 16 bits it runs flash attention's kernel with its log-sum-exp, here the same merge
over fp32 math."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from ctxcache.models.packed_attention import packed_appended_attention, packs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _sdpa(q, k, v):
    t, s = q.shape[2], k.shape[2]
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=causal_lower_right(t, s),
                                          enable_gqa=True)


@pytest.mark.parametrize("hq,hkv,t,s", [(32, 8, 32, 4128), (12, 4, 5, 700), (4, 4, 1, 300), (8, 2, 64, 1025),
                                        (6, 2, 3, 257 + 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_equals_sdpa(hq, hkv, t, s, dtype):
    g = torch.Generator().manual_seed(hq * t + s)
    q = torch.randn(1, hq, t, 64, generator=g).to(DEVICE, dtype)
    kv = torch.randn(2, 1, hkv, s + 40, 64, generator=g).to(DEVICE, dtype)
    k, v = kv[0][:, :, :s], kv[1][:, :, :s]  # a cache's first s keys: strided, as the slot's are
    assert packs(q, k)
    out = packed_appended_attention(q, k, v)
    assert out.dtype == dtype and out.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), _sdpa(q, k, v), rtol=tol, atol=tol)


@pytest.mark.parametrize("spans", [1, 2, 7])
def test_every_span_count_merges_alike(spans):
    q = torch.randn(1, 8, 4, 32, device=DEVICE)
    k, v = torch.randn(2, 1, 2, 2000, 32, device=DEVICE)
    torch.testing.assert_close(packed_appended_attention(q, k, v, spans), _sdpa(q, k, v), rtol=1e-5, atol=1e-5)


def test_short_contexts_and_long_prompts_are_not_packed():
    assert not packs(torch.zeros(1, 4, 8, 16), torch.zeros(1, 2, 200, 16))  # 192 context keys: below one span
    assert not packs(torch.zeros(1, 4, 300, 16), torch.zeros(1, 2, 4000, 16))  # 600 rows a KV head
