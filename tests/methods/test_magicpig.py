"""MagicPIG against a naive reference of its own math (Eq. 10, Eq. 11, SimHash sampling)."""

from __future__ import annotations

import math

import torch

from ctxcache.methods import Budget, make_method
from ctxcache.methods.magicpig import MagicPIG, MagicPIGParams, is_estimate, sampling_probability

from .helpers import dense_out, make_qkv


def test_estimator_with_everything_sampled_at_u1_is_exact_attention():
    q, k, v, qd = make_qkv()
    use = torch.ones(2, 2, k.shape[1], dtype=torch.bool)
    out = is_estimate(qd.view(2, 2, -1), k, v, use, torch.zeros(use.shape))
    torch.testing.assert_close(out.reshape(qd.shape), dense_out(qd, k, v), rtol=1e-5, atol=1e-5)


def test_eq10_matches_the_hashing_it_describes():
    """Empirical P[collide in >= 2 of L tables] over many independent projectors equals u."""
    d, trials = 16, 400
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(d, generator=gen)
    other = torch.randn(d, generator=gen)
    other = other - (other @ q) / (q @ q) * q  # orthogonal to q
    cosines = torch.tensor([0.95, 0.7, 0.3])
    keys = torch.stack([c * q / q.norm() + math.sqrt(1 - c * c) * other / other.norm() for c in cosines])
    hits = torch.zeros(len(cosines))
    for seed in range(trials):
        m = MagicPIG(MagicPIGParams(bits=3, tables=6, center=False, seed=seed))
        hits += ((m.hash(keys) == m.hash(q)).sum(-1) >= 2).float()
    u = sampling_probability(cosines, 3, 6, 2).float()
    tol = 4 * (u * (1 - u) / trials).sqrt() + 0.01
    assert ((hits / trials - u).abs() <= tol).all(), (hits / trials, u)


def naive_attend(m: MagicPIG, tables, qd, k, v, lo, hi):
    """Per query head, per key: the paper's Algorithm 1 written out with Python loops."""
    p = m.params
    hkv, n, d = k.shape
    g = qd.shape[0] // hkv
    codes_k = m.hash(k - tables["key_mean"][:, None])
    out = torch.zeros_like(qd)
    for h in range(qd.shape[0]):
        kv = h // g
        code_q = m.hash(qd[h])
        num, den = torch.zeros(d), 0.0
        for i in range(n):
            static = i < lo or i >= hi
            sampled = int((codes_k[kv, i] == code_q).sum()) >= 2
            if not (static or sampled):
                continue
            kc = k[kv, i] - tables["key_mean"][kv]
            cos = float(qd[h] @ kc / (qd[h].norm() * kc.norm()))
            pr = 1 - math.acos(max(-1.0, min(1.0, cos))) / math.pi
            u = 1.0 if static else 1 - (1 - pr ** p.bits) ** p.tables - \
                p.tables * pr ** p.bits * (1 - pr ** p.bits) ** (p.tables - 1)
            w = math.exp(float(qd[h] @ k[kv, i]) / math.sqrt(d)) / u
            num += w * v[kv, i]
            den += w
        out[h] = num / den
    return out


def test_attend_matches_naive_algorithm():
    q, k, v, qd = make_qkv(n=120, d=16)
    qd = qd / 3  # keep exp() of the naive loop in range
    m = make_method("magicpig", {"bits": 4, "tables": 20})
    tables = m.build(q, k, v)
    budget = Budget(0.1, 4, 8)
    out, read = m.attend(m.open(tables), qd, k, v, 120, budget)
    lo, hi = budget.region(120)
    torch.testing.assert_close(out, naive_attend(m, tables, qd, k, v, lo, hi), rtol=1e-4, atol=1e-4)
    assert sum(r.unique().numel() for r in read) < 2 * 120  # it samples, it does not read everything


def test_append_hashes_generated_keys_with_the_prefill_mean():
    q, k, v, qd = make_qkv(n=100)
    m = make_method("magicpig")
    state = m.open(m.build(q[:, :80], k[:, :80], v[:, :80]))
    m.append(state, k[:, 80:], 80)
    want = m.hash(k - state.tables["key_mean"][:, None])
    assert torch.equal(m._codes(state, 100)[:, 80:], want[:, 80:])
    assert torch.equal(m._codes(state, 100)[:, :80], state.tables["codes"])


def test_more_bits_sample_fewer_keys():
    q, k, v, qd = make_qkv(n=400)
    fractions = []
    for bits, tables in ((8, 75), (10, 150)):
        m = make_method("magicpig", {"bits": bits, "tables": tables})
        state = m.open(m.build(q, k, v))
        m.attend(state, qd, k, v, 400, Budget(0.05, 4, 16))
        got, total = state.extra["sampled_stats"]
        fractions.append(got / total)
    assert 0 < fractions[1] < fractions[0] < 1
