"""CTkvr against a naive reference of recall + rerank, and the FIFO centroid update."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ctxcache.methods import make_method

from .helpers import make_qkv


def rerank_scores(qd, k, ids):
    """Sum over the group of softmax(q.k / sqrt(d)) over the candidate ids: {id: score} per head."""
    hkv, _, d = k.shape
    out = []
    for h in range(hkv):
        ids_h = sorted(ids[h])
        logits = torch.einsum("gd,nd->gn", qd.view(hkv, -1, d)[h], k[h, ids_h]) * d ** -0.5
        out.append(dict(zip(ids_h, logits.softmax(-1).sum(0).tolist())))
    return out


def test_all_centroids_and_full_lists_is_exact_top_b():
    q, k, v, qd = make_qkv(n=200)
    m = make_method("ctkvr", {"centroids": 40, "recall": 40, "keys_per_centroid": 200,
                              "dynamic_update": False})
    state = m.open(m.build(q, k, v))
    lo, hi = 4, 180
    for b in (10, 60, 500):
        idx = m.search(state, qd, k, lo, hi, b)
        score = rerank_scores(qd, k, [range(lo, hi)] * 2)
        for h in range(2):
            want = sorted(score[h], key=score[h].get, reverse=True)[:min(b, hi - lo)]
            assert sorted(idx[h].tolist()) == sorted(want)


def test_recall_then_rerank_matches_naive_two_stage_search():
    q, k, v, qd = make_qkv(n=300)
    m = make_method("ctkvr", {"centroids": 60, "recall": 3, "keys_per_centroid": 20,
                              "dynamic_update": False})
    t = m.build(q, k, v)
    # centroids are the last 30 positions of both heads of each group
    assert torch.equal(t["centroids"][0, -1], q[1, -1].half())
    lo, hi = 4, 284
    cent = t["centroids"].float()
    for b, h in [(25, 0), (25, 1), (80, 0), (80, 1)]:  # 80 > recalled: the fill is exercised
        idx = m.search(m.open(t), qd, k, lo, hi, b)
        cos = (F.normalize(qd.view(2, 2, -1)[h], dim=-1) @ F.normalize(cent[h], dim=-1).T).amax(0)
        top = cos.topk(3).indices
        recalled = {int(i) for i in t["lists"][h, top].flatten() if lo <= int(i) < hi}
        score = rerank_scores(qd, k, [recalled, recalled])[h]
        want = sorted(score, key=score.get, reverse=True)[:b]
        got = idx[h].tolist()
        assert len(got) == b and set(want) <= set(got)  # the reranked recalled keys ...
        fill = sorted(set(got) - set(want))  # ... then the most recent others fill up to b
        assert len(fill) == max(0, b - len(recalled))
        if fill:
            assert fill == sorted(set(range(lo, hi)) - recalled)[-len(fill):]


def test_fifo_update_replaces_oldest_prefill_centroids():
    q, k, v, qd = make_qkv(n=200)
    m = make_method("ctkvr", {"centroids": 10, "recall": 2, "keys_per_centroid": 16})
    state = m.open(m.build(q, k, v))
    m.search(state, qd, k, 4, 180, 8)
    cent, lists = m._ivf(state)
    assert cent.shape[1] == 10
    assert torch.equal(cent[:, :8], state.tables["centroids"][:, 2:].float())  # 2 oldest left
    torch.testing.assert_close(cent[:, 8:], qd.view(2, 2, -1))
    assert (lists[:, 8:, :8] >= 0).all() and (lists[:, 8:, 8:] == -1).all()
    for step in range(6):
        m.search(state, qd + step, k, 4, 180, 8)
    cent, _ = m._ivf(state)
    assert cent.shape[1] == 10 and torch.equal(cent, state.extra["dyn_cent"])


def test_generated_keys_are_always_recalled():
    q, k, v, qd = make_qkv(n=220)
    m = make_method("ctkvr", {"centroids": 10, "recall": 1, "keys_per_centroid": 5,
                              "dynamic_update": False})
    state = m.open(m.build(q[:, :200], k[:, :200], v[:, :200]))
    m.append(state, k[:, 200:], 200)
    assert m.recall_mask(state, qd, 220, 4, 215)[:, 200:215].all()
