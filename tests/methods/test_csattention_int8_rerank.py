"""The int8-key re-rank lever: the rows it scores are the int8 codec's keys, its criterion is
exact_rerank's, and its bytes stay within the fp16 re-rank's at rerank 5.8 vs 4."""

from __future__ import annotations

import torch

from ctxcache.kv_codec import CodedKV, int8_keys
from ctxcache.methods import make_method
from ctxcache.methods.base import LayerState
from ctxcache.methods.csattention import exact_rerank
from ctxcache.methods.csattention_int8_rerank import int8_key_rows, rerank_from_rows
from ctxcache.models.attention import select_keys


def test_int8_keys_are_what_the_codec_decodes():
    k = torch.randn(3, 300, 64).half()
    decoded, _ = CodedKV.encode(k, k, "int8").decode()
    assert torch.equal(int8_keys(k).half(), decoded)


def test_rows_of_a_growing_cache_match_the_codec_on_every_step():
    torch.manual_seed(0)
    keys = torch.randn(2, 400, 16)
    state = LayerState(tables={})
    for n in (130, 255, 256, 257, 400):  # before, at and after group boundaries, cache reused
        idx = torch.randint(0, n, (2, 37))
        got = int8_key_rows(state, keys[:, :n], idx)
        assert torch.equal(got, select_keys(int8_keys(keys[:, :n]), idx)), n


def test_rerank_from_rows_is_exact_rerank_on_the_same_keys():
    torch.manual_seed(1)
    q, keys = torch.randn(6, 32), torch.randn(2, 500, 32)
    cand, others = torch.randint(4, 460, (2, 80)), torch.arange(460, 500).expand(2, -1)
    rows = select_keys(keys, torch.cat([cand, others], 1))
    want = exact_rerank(q, keys, cand, 20, others)
    assert torch.equal(rerank_from_rows(q, rows, cand, 20).sort(1).values, want.sort(1).values)


def test_search_with_int8_keys_returns_k_candidates_and_reads_no_more_bytes():
    torch.manual_seed(2)
    q, k = torch.randn(6, 500, 64), torch.randn(2, 500, 64)
    m = make_method("csattention", {"rerank": 5.8, "rerank_keys": "int8"})
    state = m.open(m.restore(m.build(q, k, k), k, on_demand=True))
    found = m.search(state, torch.randn(6, 64), k, 4, 468, 25)
    assert found.shape == (2, 25) and bool(((found >= 4) & (found < 468)).all())
    fp16 = make_method("csattention").search_key_bytes(205, 4060, 64, 2)
    assert m.search_key_bytes(205, 4060, 64, 2) <= fp16
    assert not m.params.gpu_selectable  # the GPU re-ranks fp16 keys: not this selection
