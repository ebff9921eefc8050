"""GpuSparseAttention with attn_cfg rerank_logits (the chosen keys' logits from the re-rank, V
alone read for them; kernels.logit_attention) against the default (K and V of the chosen keys
read again): the same chosen keys and the same output up to fp32 rounding, for a step of
random dense tables with the re-rank (16-bit keys: bf16; fp32 scores: fp32) and with follow.
On CPU through the Triton interpreter."""

import pytest
import torch
import torch.nn.functional as F

from ctxcache.decoder.gpu.attention import GpuSparseAttention
from ctxcache.decoder.gpu.selector import GpuDenseTables
from ctxcache.methods import Budget
from ctxcache.methods.csattention import CSAttentionParams
from ctxcache.models.kv_cache import KVCache

pytestmark = pytest.mark.usefixtures("small_score_pad")  # kernels/conftest.py: why
B, HQ, HKV, D, MAX_LEN, MAX_NEW = 2, 8, 2, 32, 320, 4
N = (300, 171)  # cached keys per row, the step's own key last


def _tables(params: CSAttentionParams, device) -> GpuDenseTables:
    """Random fp16 dense tables of the keys before each row's last (which the step inserts)."""
    gen = torch.Generator().manual_seed(5)
    m, c = params.subspaces, params.centroids
    n_tab = torch.tensor(N, dtype=torch.int32) - 1
    cent = F.normalize(torch.randn(B, HKV, m, c, D // m, generator=gen), dim=-1).half()
    dense = torch.randn(B, HKV, m, c, -(-max(N) // 16) * 16, generator=gen).half()
    t = GpuDenseTables(cent, dense, None, n_tab, torch.zeros(B, HKV, m, c, MAX_NEW), n_tab.clone(),
                       torch.zeros(B, dtype=torch.int32))
    return GpuDenseTables(*(x.to(device) if x is not None else None for x in (
        t.centroids, t.dense_score, t.score_scale, t.n_ctx, t.new_scores, t.stream_start, t.stream_count)))


def _step(params: CSAttentionParams, dtype: torch.dtype, device, rerank_logits: bool):
    gen = torch.Generator().manual_seed(6)
    cache = KVCache(1, B, HKV, MAX_LEN, D, dtype, device)
    cache.k[0].copy_(torch.randn(B, HKV, MAX_LEN, D, generator=gen).to(dtype))
    cache.v[0].copy_(torch.randn(B, HKV, MAX_LEN, D, generator=gen).to(dtype))
    q = torch.randn(B, HQ, 1, D, generator=gen).to(dtype).to(device)
    pos = torch.tensor(N, device=device)[:, None] - 1
    attn = GpuSparseAttention(params, [_tables(params, device)], Budget(0.05, 4, 16), B, HQ, HKV, D, MAX_LEN,
                              attn_cfg={"rerank_logits": rerank_logits})
    attn.record = True
    out = attn(0, q, cache, pos)
    idx, k = attn.last_idx[0]
    return out[:, :, 0], idx.cpu(), k.cpu(), attn


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("follow", [0, 8])
def test_rerank_logits_step_equals_the_default(device, dtype, follow):
    params = CSAttentionParams(subspaces=4, centroids=16, rerank=4.0, follow=follow)
    want, want_idx, k, plain = _step(params, dtype, device, False)
    got, got_idx, k2, kept = _step(params, dtype, device, True)
    assert kept.rerank_logits and kept.reranker.keep_logits and not plain.rerank_logits
    assert torch.equal(k, k2) and int(k.min()) > 0
    for b in range(B):  # the same chosen keys (the kernels collect them in any order)
        for h in range(HKV):
            assert sorted(got_idx[b, h, :k[b]].tolist()) == sorted(want_idx[b, h, :k[b]].tolist()), (b, h)
    if follow:
        assert torch.equal(plain.tables[0].follow_prev.sort(-1).values, kept.tables[0].follow_prev.sort(-1).values)
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-4, atol=1e-4)


def test_without_a_rerank_the_flag_does_nothing(device):
    params = CSAttentionParams(subspaces=4, centroids=16, rerank=1.0, follow=0)
    *_, attn = _step(params, torch.float32, device, True)
    assert not attn.rerank_logits


def test_refuses_an_unknown_attn_cfg_key(device):
    params = CSAttentionParams(subspaces=4, centroids=16, rerank=4.0, follow=0)
    with pytest.raises(ValueError, match="rerank_logit"):
        GpuSparseAttention(params, [_tables(params, device)], Budget(0.05, 4, 16), B, HQ, HKV, D, MAX_LEN,
                           attn_cfg={"rerank_logit": True})
