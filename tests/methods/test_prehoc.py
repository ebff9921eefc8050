"""Pre-hoc sparsity: CIS reduces to per-step exact top-k when nothing is shared, shares the
dilated reference set otherwise, restarts at block boundaries; PSAW follows Eq. 15."""

from __future__ import annotations

import math

import pytest
import torch

from ctxcache.methods import make_method
from ctxcache.methods.oracle import Oracle
from ctxcache.methods.prehoc import PrehocParams, psaw_start

from .helpers import make_qkv


def test_tau_above_one_is_per_step_exact_top_k():
    q, k, v, qd = make_qkv(n=300)
    m, oracle = make_method("prehoc", {"tau": 1.01}), Oracle()
    state = m.open(m.build(q, k, v))
    for step in range(20):
        qs = qd + 0.05 * step * torch.randn(qd.shape)
        got = m.search(state, qs, k, 4, 284, 30)
        want = oracle.search(oracle.open({}), qs, k, 4, 284, 30)
        assert torch.equal(got.sort(-1).values, want.sort(-1).values)


def naive_dilate(ranked, m, r, lo, hi, k):
    out = []
    for p in ranked[:m]:
        for j in sorted(range(-r, r + 1), key=abs):
            if lo <= p + j < hi and p + j not in out:
                out.append(p + j)
    out += [p for p in ranked[m:] if p not in out]
    return out[:k]


def test_shared_set_is_the_dilated_reference_set_and_blocks_restart():
    q, k, v, qd = make_qkv(n=300)
    m, oracle = make_method("prehoc", {"tau": -1.0, "block": 4, "radius": 2}), Oracle()
    state = m.open(m.build(q, k, v))
    first = m.search(state, qd, k, 4, 284, 30)  # reference
    probs = oracle.search(oracle.open({}), qd, k, 4, 284, 30)
    assert torch.equal(first.sort(-1).values, probs.sort(-1).values)
    other = torch.randn(qd.shape)
    shared = m.search(state, other, k, 4, 284, 30)  # tau = -1: always shares
    for h in range(2):
        want = naive_dilate(first[h].tolist(), 10, 2, 4, 284, 30)
        assert shared[h].tolist() == want
    m.search(state, other, k, 4, 284, 30)
    m.search(state, other, k, 4, 284, 30)
    fresh = m.search(state, other, k, 4, 284, 30)  # step 4: a new block, a new reference
    want = oracle.search(oracle.open({}), other, k, 4, 284, 30)
    assert torch.equal(fresh.sort(-1).values, want.sort(-1).values)


def test_psaw_schedule_and_region():
    p = PrehocParams(psaw=True)
    assert psaw_start(10, 30, 1000, p) == 0  # below l_s = 22
    assert psaw_start(22, 30, 1000, p) == 0
    assert psaw_start(29, 30, 1000, p) == math.floor((1 - 0.7 ** (7 / 8)) * 1000)
    q, k, v, qd = make_qkv(n=300)
    m = make_method("prehoc", {"psaw": True, "tau": 2.0})
    state = m.open(m.build_layer(q, k, v, 29, 30))
    start = psaw_start(29, 30, 300, m.params)
    idx = m.search(state, qd, k, 4, 284, 30)
    assert int(idx.min()) >= start and idx.shape[1] == 30
    with pytest.raises(ValueError, match="layer"):
        m.build(q, k, v)


def test_psaw_through_the_indexer_and_decoder(monkeypatch):
    """The indexer passes each layer's index (build_layer), so PSAW prunes the last layer's
    region during a real decode (l_s = 0 here, so layer 1 of 2 starts at 0.16 t)."""
    from ctxcache.decoder import SparseConfig, generate
    from ctxcache.generation import SamplingParams
    from ctxcache.indexer import IndexerConfig, build_artifact
    from ctxcache.methods import Budget
    from ctxcache.models.loader import load_model

    lm = load_model("random:tiny")  # 2 layers
    ids = torch.randint(0, lm.args.vocab_size, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    m = make_method("prehoc", {"psaw": True, "psaw_start": 0.0, "tau": 2.0})
    art = build_artifact(lm, ids, m, IndexerConfig(progress=False, kv_dtype="float32"))
    assert [a.tables["layer"].tolist() for a in art.layers] == [[0, 2], [1, 2]]
    seen = []
    from ctxcache.methods.prehoc import Prehoc
    search = Prehoc.search

    def spy(self, state, q, keys, lo, hi, k):  # the decoder makes its own method instance
        idx = search(self, state, q, keys, lo, hi, k)
        seen.append((int(state.tables["layer"][0]), keys.shape[1], int(idx.min())))
        return idx

    monkeypatch.setattr(Prehoc, "search", spy)
    steps = list(generate(lm, [art], [[5, 6, 7]], SamplingParams(max_tokens=4), SparseConfig(Budget(0.1, 4, 8))))
    assert len(steps) == 4 and {layer for layer, _, _ in seen} == {0, 1}
    for layer, n, low in seen:
        if layer == 1:
            assert low >= psaw_start(1, 2, n, m.params) > 4  # pruned past the sinks
