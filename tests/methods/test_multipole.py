"""Multipole attention against a naive reference of Eq. 1 / Eq. 2, and its online update."""

from __future__ import annotations

import math

import torch

from ctxcache.methods import Budget, make_method

from .helpers import dense_out, make_qkv


def test_every_cluster_selected_is_exact_attention():
    q, k, v, qd = make_qkv(n=300)
    m = make_method("multipole")
    out, read = m.attend(m.open(m.build(q, k, v)), qd, k, v, 300, Budget(1.0, 4, 16))
    torch.testing.assert_close(out, dense_out(qd, k, v), rtol=1e-5, atol=1e-5)
    assert [r.unique().numel() for r in read] == [300, 300]


def test_centroid_term_is_exact_for_clusters_of_identical_keys():
    """N_i exp(q.Kc_i) Vc_i is exact when a cluster's keys coincide (values may differ)."""
    q, k, v, qd = make_qkv(n=20 * 16 + 36)
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(2, 20, 32, generator=gen)
    k[:, 4:324] = base.repeat_interleave(16, dim=1)[:, torch.randperm(320, generator=gen)]
    m = make_method("multipole")
    out, read = m.attend(m.open(m.build(q, k, v)), qd, k, v, k.shape[1], Budget(0.05, 4, 32))
    assert sum(r.unique().numel() for r in read) < 2 * k.shape[1]  # most clusters were approximated
    torch.testing.assert_close(out, dense_out(qd, k, v), rtol=1e-3, atol=1e-3)


def naive(t, qd, k, v, n, budget):
    """Eq. 1 ranking, whole clusters under the budget, Eq. 2 for the rest, with Python loops."""
    hkv, _, d = k.shape
    c_start, c_end = int(t["span"][0]), int(t["span"][1])
    lo, hi = budget.region(n)
    static = [i < lo or i >= hi or i < c_start or i >= c_end for i in range(n)]
    left = budget.top_k(n) - sum(1 for i in range(lo, hi) if static[i])
    out = torch.zeros_like(qd)
    g = qd.shape[0] // hkv
    for h in range(hkv):
        kc, vc = t["centroids"][h].float(), t["vcentroids"][h].float()
        members = {}
        for i in range(c_start, c_end):
            if not static[i]:
                members.setdefault(int(t["assign"][h, i - c_start]), []).append(i)
        imp = {}
        for c, mem in members.items():
            s = [math.exp(float(qd[h * g + j] @ kc[c]) / math.sqrt(d)) /
                 sum(len(mm) * math.exp(float(qd[h * g + j] @ kc[cc]) / math.sqrt(d)) for cc, mm in members.items())
                 for j in range(g)]
            imp[c] = sum(s) / g
        chosen, used = set(), 0
        for c in sorted(imp, key=imp.get, reverse=True):
            if used + len(members[c]) > left:
                break
            chosen.add(c)
            used += len(members[c])
        for j in range(g):
            qh = qd[h * g + j]
            num, den = torch.zeros(d), 0.0
            exact = [i for i in range(n) if static[i]] + [i for c in chosen for i in members[c]]
            for i in exact:
                w = math.exp(float(qh @ k[h, i]) / math.sqrt(d))
                num, den = num + w * v[h, i], den + w
            for c, mem in members.items():
                if c not in chosen:
                    w = len(mem) * math.exp(float(qh @ kc[c]) / math.sqrt(d))
                    num, den = num + w * vc[c], den + w
            out[h * g + j] = num / den
    return out


def test_partial_selection_matches_naive_reference():
    q, k, v, qd = make_qkv(n=260)
    qd = qd / 3
    m = make_method("multipole", {"sinks": 2})  # differs from the budget's 4 sinks on purpose
    t = m.build(q, k, v)
    budget = Budget(0.2, 4, 16)
    out, _ = m.attend(m.open(t), qd, k, v, 260, budget)
    torch.testing.assert_close(out, naive(t, qd, k, v, 260, budget), rtol=1e-4, atol=1e-4)


def test_blocks_and_one_centroid_per_16_tokens():
    q, k, v, qd = make_qkv(n=300)
    t = make_method("multipole", {"block": 64, "slack": 0.5}).build(q, k, v)
    # clustered [4, 268): blocks of 64 while more than 96 remain -> 64, 64, 64, 72 tokens
    assert t["centroids"].shape[1] == 4 + 4 + 4 + 5
    assert t["span"].tolist() == [4, 268, 196, 12]
    for h in range(2):
        assert set(t["assign"][h, 192:].tolist()) <= set(range(12, 17))


def test_online_update_clusters_generated_tokens_and_stays_exact_at_full_budget():
    q, k, v, qd = make_qkv(n=400)
    m = make_method("multipole", {"local": 16})
    state = m.open(m.build(q[:, :300], k[:, :300], v[:, :300]))
    assert state.tables["span"].tolist()[:2] == [4, 284]
    for n in (310, 332, 400):
        out, _ = m.attend(state, qd, k, v, n, Budget(1.0, 4, 8))
        torch.testing.assert_close(out, dense_out(qd, k[:, :n], v[:, :n]), rtol=1e-5, atol=1e-5)
    span = state.extra["clusters"]["span"]
    assert span[1] == 284 + 16 * 6 and 400 - span[1] < 32  # tail kept between L and 2L
    cl = state.extra["clusters"]
    assert cl["assign"].shape[1] == span[1] - 4 and cl["kc"].shape[1] > state.tables["centroids"].shape[1]
    assert torch.equal(cl["n"].sum(-1), torch.full((2,), float(span[1] - 4)))
    # the prefill tables are untouched by the stream
    assert state.tables["assign"].shape[1] == 280
