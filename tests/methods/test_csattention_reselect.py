"""CSAttention's reselect: the estimate proposes on one step in `reselect`, the steps between
re-rank the previous selection, its best keys' successors and the keys new to the region."""

from __future__ import annotations

import pytest
import torch

from ctxcache.methods import Budget
from ctxcache.methods.base import ParamError
from ctxcache.methods.csattention import CSAttention, CSAttentionParams
from ctxcache.methods.csattention_refs import carried_candidates, exact_rerank

from tests.methods.helpers import make_qkv

BUDGET = Budget(0.05, 4, 16)


@pytest.fixture(scope="module")
def qkv():
    return make_qkv(hq=6, hkv=2, n=400, d=32, seed=3)


def test_carried_candidates_are_the_distinct_selection_successors_and_new_keys_in_the_region():
    extra = {"chosen_prev": torch.tensor([[10, 11, 30], [5, 40, 41]]), "chosen_hi": 48,
             "follow_prev": torch.tensor([[10, 30], [41, 99]])}  # 11 already chosen; 100 outside
    cand, valid = carried_candidates(extra, lo=4, hi=50, k=3)
    rows = [set(c[v].tolist()) for c, v in zip(cand, valid)]
    assert rows == [{10, 11, 30, 31, 48, 49}, {5, 40, 41, 42, 48, 49}]
    assert all(len(c[v]) == len(set(c[v].tolist())) for c, v in zip(cand, valid))
    assert carried_candidates(extra, lo=4, hi=50, k=7) is None  # a row short of k: select afresh


def test_padded_candidates_are_neither_normalized_over_nor_chosen():
    torch.manual_seed(0)
    keys, q = torch.randn(1, 20, 8), torch.randn(3, 8)
    cand = torch.tensor([[2, 7, 9, 13]])
    plain = exact_rerank(q, keys, cand, 2, ordered=True)
    padded = torch.tensor([[2, 7, 9, 13, 2, 2]])
    valid = torch.tensor([[True, True, True, True, False, False]])
    assert torch.equal(exact_rerank(q, keys, padded, 2, ordered=True, valid=valid), plain)
    assert len(set(exact_rerank(q, keys, padded, 4, valid=valid)[0].tolist())) == 4


def test_reselect_skips_the_estimate_between_selections_and_stays_in_the_carried_set(qkv, monkeypatch):
    q, k, v, q_dec = qkv
    method = CSAttention(CSAttentionParams(centroids=8, rerank=4.0, follow=4, reselect=3))
    state = method.open(method.build(q, k, v))
    calls = []
    estimate = method.estimate
    monkeypatch.setattr(method, "estimate", lambda *a, **kw: calls.append(1) or estimate(*a, **kw))
    torch.manual_seed(1)
    for step in range(6):
        lo, hi = 4, 380 + step  # the region's end moves a key a step, as when decoding
        kk = BUDGET.top_k(hi)
        before = dict(state.extra)
        got = method.search(state, q_dec + 0.1 * torch.randn_like(q_dec), k, lo, hi, kk)
        chosen = state.extra["chosen_prev"]  # the re-rank's K: what the next step carries
        assert chosen.shape == (2, kk) and all(len(set(r.tolist())) == kk for r in chosen)
        assert ((chosen >= lo) & (chosen < hi)).all()
        if step % 3 == 0:
            assert torch.equal(got, chosen)
            continue
        # a carried step attends every candidate (-1 pads a head with fewer) and keeps K of them
        carried, valid = carried_candidates(before, lo, hi, kk)
        for g, c, ok, kept in zip(got, carried, valid, chosen):
            assert sorted(x for x in g.tolist() if x >= 0) == sorted(c[ok].tolist())
            assert set(kept.tolist()) <= set(c[ok].tolist())
    assert len(calls) == 2  # steps 0 and 3


def test_reselect_is_validated_quiet_at_its_default_and_spans_steps_only_with_follow(qkv):
    with pytest.raises(ParamError, match="reselect"):
        CSAttentionParams.from_dict({"reselect": 0})
    assert "reselect" not in CSAttentionParams().to_dict() and CSAttentionParams().reselects == 2
    assert CSAttentionParams(reselect=1).to_dict()["reselect"] == 1
    assert CSAttentionParams(reselect=2).gpu_selectable and CSAttentionParams(reselect=2, follow=0).gpu_selectable
    # a carried step's new candidates are follow's successors: without follow (or a re-rank) every step selects
    assert CSAttentionParams(reselect=2, rerank=1.0).reselects == 1
    assert CSAttentionParams(reselect=2, follow=0).reselects == 1
    method = CSAttention(CSAttentionParams(reselect=2, follow=128))
    # K = 100 in 4000 keys: 400 candidates on a selecting step, at most 100 + 128 + 1 between
    assert method.search_reads(100, 4000) == (400 + 229 + 1) // 2
