"""CSAttention's exact re-rank: candidates from the estimate, the K best by exact attention."""

from __future__ import annotations

import pytest
import torch

from ctxcache.methods import Budget, make_method
from ctxcache.methods.csattention import CSAttention, CSAttentionParams
from ctxcache.methods.csattention_refs import exact_rerank, promote_successors
from ctxcache.methods.oracle import Oracle

from tests.methods.helpers import make_qkv

BUDGET = Budget(0.05, 4, 16)


@pytest.fixture(scope="module")
def qkv():
    return make_qkv(hq=6, hkv=2, n=400, d=32, seed=3)


def _tables(params: CSAttentionParams, q, k, v):
    return CSAttention(params).build(q, k, v)


def test_rerank_over_the_whole_region_is_the_oracle(qkv):
    q, k, v, q_dec = qkv
    method = CSAttention(CSAttentionParams(centroids=8, rerank=64.0))
    state = method.open(_tables(method.params, q, k, v))
    lo, hi = BUDGET.region(k.shape[1])
    kk = BUDGET.top_k(k.shape[1])
    assert method.params.candidates(kk, hi - lo) == hi - lo  # every region key is a candidate
    got = method.search(state, q_dec, k, lo, hi, kk)
    want = Oracle().search(Oracle().open({}), q_dec, k, lo, hi, kk)
    assert got.shape == want.shape
    assert all(set(g.tolist()) == set(w.tolist()) for g, w in zip(got, want))


def test_rerank_keeps_the_best_candidates_and_counts_them_as_read(qkv):
    q, k, v, q_dec = qkv
    plain = CSAttention(CSAttentionParams(centroids=8, rerank=1.0))
    ranked = CSAttention(CSAttentionParams(centroids=8, rerank=3.0))
    tables = _tables(plain.params, q, k, v)  # rerank changes only the search: same tables
    assert "rerank" in CSAttention.search_params
    lo, hi = BUDGET.region(k.shape[1])
    kk = BUDGET.top_k(k.shape[1])
    cand = CSAttention(CSAttentionParams(centroids=8, rerank=1.0)).search(
        plain.open(tables), q_dec, k, lo, hi, 3 * kk)
    got = ranked.search(ranked.open(tables), q_dec, k, lo, hi, kk)
    assert got.shape == (2, kk)
    assert all(set(g.tolist()) <= set(c.tolist()) for g, c in zip(got, cand))
    assert set(got.flatten().tolist()) != set(plain.search(plain.open(tables), q_dec, k, lo, hi, kk).flatten().tolist())
    assert ranked.search_reads(kk, hi - lo) == 3 * kk and plain.search_reads(kk, hi - lo) == kk


def test_exact_rerank_picks_the_group_probability_top():
    keys = torch.zeros(1, 5, 2)
    keys[0, :, 0] = torch.tensor([0.0, 3.0, 1.0, 5.0, 2.0])
    q = torch.tensor([[1.0, 0.0], [1.0, 0.0]])  # two query heads of one group
    got = exact_rerank(q, keys, torch.tensor([[0, 1, 2, 4]]), 2)  # key 3 is no candidate
    assert sorted(got[0].tolist()) == [1, 4]


def test_rerank_is_validated_and_gpu_decodable(qkv):
    with pytest.raises(ValueError, match="rerank=0.5"):
        CSAttentionParams(rerank=0.5)
    with pytest.raises(ValueError, match="rerank=100"):
        make_method("csattention", {"rerank": 100.0})
    q, k, v, _ = qkv
    tables = _tables(CSAttentionParams(centroids=8), q, k, v)
    for rerank in (1.0, 2.0, None):  # None: the default (4); the GPU re-ranks in decoder/gpu/attention
        params = CSAttentionParams(centroids=8) if rerank is None else CSAttentionParams(centroids=8, rerank=rerank)
        assert CSAttention(params).params.gpu_selectable and CSAttention(params).gpu_decodable(tables)


def test_decoder_counts_the_rerank_candidates_as_read(qkv):
    from ctxcache.decoder.reference_attention import ReferenceSparseAttention, SparseConfig

    q, k, v, q_dec = qkv
    n, config = k.shape[1], SparseConfig(BUDGET)
    lo, hi = BUDGET.region(n)
    reads = {}
    for rerank in (1.0, 3.0):
        method = CSAttention(CSAttentionParams(centroids=8, rerank=rerank))
        attn = ReferenceSparseAttention(method, [[method.open(_tables(method.params, q, k, v))]], config)
        cache = type("C", (), {"k": [k[None]], "v": [v[None]]})()
        attn._row(0, 0, q_dec, cache, n)
        reads[rerank] = attn.keys_read
    kk = BUDGET.top_k(n)
    assert reads[1.0] == 2 * (lo + n - hi + kk)
    assert reads[3.0] == 2 * (lo + n - hi + 3 * kk)


def test_exact_rerank_ordered_is_best_first():
    keys = torch.zeros(1, 5, 2)
    keys[0, :, 0] = torch.tensor([0.0, 3.0, 1.0, 5.0, 2.0])
    q = torch.tensor([[1.0, 0.0]])
    got = exact_rerank(q, keys, torch.tensor([[0, 1, 2, 3, 4]]), 3, ordered=True)
    assert got[0].tolist() == [3, 1, 4]


def test_follow_proposes_the_successor_of_the_previous_best_key(qkv):
    q, k, v, q_dec = qkv
    tables = _tables(CSAttentionParams(centroids=8), q, k, v)  # follow changes only the search
    assert "follow" in CSAttention.search_params
    lo, hi = BUDGET.region(k.shape[1])
    kk = BUDGET.top_k(k.shape[1])
    plain, follow = CSAttention(CSAttentionParams(centroids=8)), CSAttention(CSAttentionParams(centroids=8, follow=2))
    # the key the stale estimate ranks last in head 0 becomes the one every query of head 0
    # attends to: only a search told to look right after its predecessor proposes it
    est = plain._combine(plain.estimate(plain.open(tables), q_dec, k.shape[1]), q_dec.shape[-1])
    t = lo + 1 + int(est[0, lo + 1:hi].argmin())
    keys = k.clone()
    keys[0, t] = 50 * q_dec.view(2, -1, k.shape[-1])[0].sum(0)
    without = plain.search(plain.open(tables), q_dec, keys, lo, hi, kk)
    assert t not in without[0].tolist()
    state = follow.open(tables)
    first = follow.search(state, q_dec, keys, lo, hi, kk)  # no previous step: the plain search
    assert [set(r.tolist()) for r in first] == [set(r.tolist()) for r in without]
    assert torch.equal(state.extra["follow_prev"], first[:, :2])
    state.extra["follow_prev"] = torch.tensor([[t - 1, lo], [lo, lo]])
    assert t in follow.search(state, q_dec, keys, lo, hi, kk)[0].tolist()


def test_follow_is_validated_inert_without_a_rerank_and_gpu_selectable_with_the_dense_layout():
    assert CSAttentionParams(follow=2, rerank=1.0).follows == 0 and CSAttentionParams(follow=2).follows == 2
    with pytest.raises(ValueError, match="follow=-1"):
        make_method("csattention", {"follow": -1})
    assert CSAttentionParams(follow=2).gpu_selectable and CSAttentionParams().gpu_selectable
    assert not CSAttentionParams(follow=2, list_fraction=0.5).gpu_selectable
    assert CSAttentionParams(follow=2, list_fraction=0.5, rerank=1.0).gpu_selectable


def test_a_dense_prompt_step_seeds_follow_with_its_last_query_best_keys(qkv):
    from ctxcache.decoder.reference_attention import ReferenceSparseAttention, SparseConfig
    from ctxcache.methods.oracle import group_probabilities

    q, k, v, q_dec = qkv
    n = k.shape[1]
    lo, hi = BUDGET.region(n)
    want = torch.topk(group_probabilities(q_dec, k).sum(1)[:, lo:hi], 3).indices + lo
    for follow, seeded in ((3, True), (0, False)):
        method = CSAttention(CSAttentionParams(centroids=8, follow=follow))
        state = method.open(_tables(method.params, q[:, :, :n - 2], k[:, :n - 2], v[:, :n - 2]))
        attn = ReferenceSparseAttention(method, [[state]], SparseConfig(BUDGET))
        cache = type("C", (), {"k": [k[None]], "v": [v[None]]})()
        prompt = torch.stack([torch.randn_like(q_dec), q_dec], dim=1)[None]  # [1, Hq, 2, D]
        attn._attend(0, prompt, cache, torch.tensor([[n - 2, n - 1]]))  # dense: a prompt's two tokens
        assert ("follow_prev" in state.extra) == seeded
        if seeded:
            assert torch.equal(state.extra["follow_prev"].sort(1).values, want.sort(1).values)


def test_promoted_successors_stay_inside_the_region_and_tie_to_the_lower_index():
    from ctxcache.methods.budget import fp16_rank

    rank = fp16_rank(torch.arange(8.0).view(1, 8))
    top = lambda i: (0xFFFF << 32) + (1 << 32) - 1 - i  # noqa: E731 - the top 16-bit key at index i
    got = promote_successors(rank, torch.tensor([[0, 3, 7]]), 1, 8)  # 1 and 4 inside; 8 past the end
    assert got[0].tolist() == [int(rank[0, 0]), top(1), *rank[0, 2:4].tolist(), top(4), *rank[0, 5:].tolist()]
    assert torch.topk(got[0], 1).indices.tolist() == [1]  # more successors than slots: the lowest wins (GPU)
    got = promote_successors(rank, torch.tensor([[6, 7]]), 1, 8)  # 7 promoted, the clamped 8 (-> 7) too
    assert got[0, 7] == top(7) and got[0, :7].tolist() == rank[0, :7].tolist()


def test_follow_at_its_default_leaves_the_parameters_and_so_the_context_id_as_before():
    from ctxcache.store import context_id_for

    before = {**CSAttentionParams().to_dict()}
    from dataclasses import fields
    assert set(before) == {f.name for f in fields(CSAttentionParams)} - {"follow", "reselect"}  # the dict ids hashed before
    assert CSAttentionParams.from_dict(before) == CSAttentionParams()
    assert CSAttentionParams(follow=8).to_dict()["follow"] == 8
    assert CSAttentionParams.from_dict(CSAttentionParams(follow=8).to_dict()) == CSAttentionParams(follow=8)
    ids = {context_id_for("m", "t", "c", "float16", 1, "csattention", p.to_dict(), [1, 2, 3])
           for p in (CSAttentionParams(), CSAttentionParams(follow=128), CSAttentionParams(follow=0))}
    assert len(ids) == 2 and CSAttentionParams().follow == 128
