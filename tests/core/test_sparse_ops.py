"""Sparse operations against naive references."""

import math

import pytest
import torch

from ctxcache.methods import Budget, CSAttentionParams, make_method
from ctxcache.methods.csattention import CSAttention
from ctxcache.methods.csattention_refs import subspace_permutation
from ctxcache.methods.kmeans import kmeans
from ctxcache.models.attention import gather_attention


def _naive_masked_attention(q, k, v, idx):
    hkv, n, d = k.shape
    g = q.shape[0] // hkv
    out = []
    for h in range(q.shape[0]):
        kv = h // g
        mask = torch.zeros(n, dtype=torch.bool)
        mask[idx[kv]] = True
        s = (k[kv] @ q[h]) / math.sqrt(d)
        p = s.masked_fill(~mask, float("-inf")).softmax(-1)
        out.append(p @ v[kv])
    return torch.stack(out)


@pytest.mark.parametrize("n,kk", [(1, 1), (7, 3), (181, 23)])
def test_gqa_sparse_attention_matches_masked_dense(n, kk):
    torch.manual_seed(n)
    q, k, v = torch.randn(6, 16), torch.randn(2, n, 16), torch.randn(2, n, 16)
    idx = torch.stack([torch.randperm(n)[:kk] for _ in range(2)])
    torch.testing.assert_close(gather_attention(q, k, v, idx), _naive_masked_attention(q, k, v, idx))


@pytest.mark.parametrize("n", [1, 3, 20, 36, 37, 500])
def test_budget_regions_partition_the_keys(n):
    b = Budget(0.05, 4, 32)
    lo, hi = b.region(n)
    static = b.static_indices(n).tolist()
    assert sorted(static + list(range(lo, hi))) == list(range(n))  # disjoint and complete
    assert b.top_k(n) == max(1, math.ceil(0.05 * n))
    with pytest.raises(ValueError, match="keep"):
        Budget(keep=0.0)


def test_kmeans_recovers_separated_clusters():
    torch.manual_seed(0)
    centers = torch.randn(1, 5, 8) * 10
    x = (centers[:, torch.arange(500) % 5] + torch.randn(1, 500, 8) * 0.1)
    cent, assign = kmeans(x, 5, iters=10, cosine=False)
    for c in range(5):  # every point of a true cluster lands in one found cluster
        assert assign[0, torch.arange(500) % 5 == c].unique().numel() == 1
    assert assign.unique().numel() == 5


def _naive_cs_scores(params, tables, q):
    """Loop-by-loop CSAttention estimate for one query head group: the paper's Sec. 3.3."""
    cent, hkv = tables["centroids"].float(), tables["centroids"].shape[0]
    perm = subspace_permutation(q.shape[-1], params.subspaces, params.layout)
    g = q.shape[0] // hkv
    n = int(tables["list_idx"].max()) + 1 if "list_idx" in tables else tables["dense_score"].shape[-1]
    out = torch.zeros(hkv, n)
    if params.routing == "group":  # one router per KV head: the sum of its query heads
        q, g = q.view(hkv, g, -1).sum(1), 1
    for h in range(q.shape[0]):
        kv, sub = h // g, q[h][perm].view(params.subspaces, -1)
        for b in range(params.subspaces):
            j = int((torch.nn.functional.normalize(sub[b], dim=0) @ cent[kv, b].T).argmax())
            w = sub[b].norm() if params.weighting == "qnorm" else 1.0
            if "dense_score" in tables:  # int8 rows dequantized by their scale
                scale = tables["dense_scale"][kv, b, j] if "dense_scale" in tables else 1.0
                out[kv] += w * tables["dense_score"][kv, b, j].float() * scale
                continue
            off = {"absolute": 0.0, "relative": float(tables["list_floor"][kv, b, j]),
                   "expected": float(tables["list_absent_mean"][kv, b, j])}[params.scoring]
            for i, s in zip(tables["list_idx"][kv, b, j].tolist(), tables["list_score"][kv, b, j].tolist()):
                out[kv, i] += w * (s - off)
    return out


@pytest.mark.parametrize("overrides", [
    {"list_fraction": 0.25, "weighting": "unit", "scoring": "absolute"},  # the paper, literally
    {"list_fraction": 0.3, "scoring": "relative"},
    {"list_fraction": 0.3, "scoring": "expected", "layout": "rope_pairs"},
    {},  # defaults: dense layout, int8 tables
    {"table_dtype": "float16"},
    {"routing": "group"},
    {"routing": "group", "list_fraction": 0.3, "scoring": "expected"},
])
def test_csattention_estimate_matches_naive_loops(overrides):
    torch.manual_seed(1)
    params = CSAttentionParams(subspaces=4, centroids=8, **overrides)
    m = CSAttention(params)
    q, k = torch.randn(4, 120, 16), torch.randn(2, 120, 16)
    tables = m.build(q, k, k)
    qt = torch.randn(4, 16)
    got = m.estimate(m.open(tables), qt, n=120).sum(1)
    want = _naive_cs_scores(params, tables, qt)
    if params.int8_tables:  # the estimate also quantizes the weights (within 1/128 of the largest)
        assert "dense_scale" in tables and (got - want).abs().max() <= 0.02 * want.abs().max()
    else:
        torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("routing", ["head", "group"])
@pytest.mark.parametrize("fraction", [0.3, 1.0])
def test_streaming_append_scores_like_a_rebuild(fraction, routing):
    """Keys appended during decode get the same estimate as if their centroid-scores had been
    in the tables (dense layout: exactly; lists: where they beat the list floor)."""
    torch.manual_seed(3)
    m = CSAttention(CSAttentionParams(subspaces=4, centroids=8, list_fraction=fraction, routing=routing))
    q, k = torch.randn(4, 100, 16), torch.randn(2, 110, 16)
    state = m.open(m.build(q, k[:, :100], k[:, :100]))
    m.append(state, k[:, 100:105], 100)
    m.append(state, k[:, 105:110], 105)
    qt = torch.randn(4, 16)
    est = m.estimate(state, qt, n=110).sum(1)
    cent = state.tables["centroids"].float()
    sub_q = m._split(m._group(qt.view(2, 2, 16)))  # [Hkv, 2 heads or 1 group sum, m, d_b]
    ids, _ = m._route(cent, sub_q)
    w = sub_q.norm(dim=-1)
    sub_k = m._split(k[:, 100:]).permute(0, 2, 1, 3)
    for kv in range(2):
        expect = torch.zeros(10)
        for g in range(sub_q.shape[1]):
            for b in range(4):
                j = int(ids[kv, g, b, 0])
                s = cent[kv, b, j] @ sub_k[kv, b].T
                if fraction < 1.0:
                    floor = state.tables["list_floor"][kv, b, j].float()
                    off = state.tables["list_absent_mean"][kv, b, j].float()
                    s = torch.where(s > floor, s - off, torch.zeros_like(s))
                expect += w[kv, g, b] * s
        torch.testing.assert_close(est[kv, 100:], expect, atol=1e-4, rtol=1e-4)


def test_group_routing_needs_the_sum_combine():
    with pytest.raises(ValueError, match="routing='group'.*group_combine='sum'"):
        CSAttentionParams(routing="group", group_combine="max")
    with pytest.raises(ValueError, match="routing"):
        CSAttentionParams(routing="heads")


def test_method_registry_errors_name_the_problem():
    with pytest.raises(ValueError, match="unknown method 'nope'"):
        make_method("nope")
    with pytest.raises(ValueError, match="unknown parameter"):
        make_method("csattention", {"centroidz": 3})
    with pytest.raises(ValueError, match="scoring='x'"):
        make_method("csattention", {"scoring": "x"})


@pytest.mark.parametrize("routing", ["head", "group"])
def test_int8_tables_estimate_close_to_fp16(routing):
    """table_dtype="int8": half the table bytes; the estimate (group sum) stays within the
    quantization error of the fp16 tables' and selects nearly the same keys."""
    torch.manual_seed(4)
    q, k = torch.randn(4, 400, 16), torch.randn(2, 400, 16)
    qt = torch.randn(4, 16)
    est, sel = {}, {}
    for dtype in ("float16", "int8"):
        m = CSAttention(CSAttentionParams(subspaces=4, centroids=8, routing=routing, table_dtype=dtype))
        tables = m.build(q, k, k)
        assert tables["dense_score"].dtype == (torch.int8 if dtype == "int8" else torch.float16)
        state = m.open(tables)
        est[dtype] = m.estimate(state, qt, n=400).sum(1)
        sel[dtype] = m.search(state, qt, k, 4, 368, 40)
    span = est["float16"].abs().amax(-1, keepdim=True)
    assert ((est["int8"] - est["float16"]).abs() <= 0.05 * span).all()
    assert (est["int8"] - est["float16"]).abs().max() > 0  # really quantized
    for h in range(2):
        overlap = len(set(sel["int8"][h].tolist()) & set(sel["float16"][h].tolist())) / 40
        assert overlap >= 0.8


def test_int8_tables_need_the_dense_layout_and_the_sum():
    with pytest.raises(ValueError, match="table_dtype='int8'"):
        CSAttentionParams(table_dtype="int8", list_fraction=0.5)
    with pytest.raises(ValueError, match="table_dtype='int8'"):
        CSAttentionParams(table_dtype="int8", routing="head", group_combine="max")
    with pytest.raises(ValueError, match="table_dtype"):
        CSAttentionParams(table_dtype="bf16")
