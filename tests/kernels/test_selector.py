"""The GPU selection pipeline picks what CSAttention.search picks on tables built by the method."""

import pytest
import torch

from ctxcache.decoder.gpu.selector import GpuSelector
from ctxcache.decoder.gpu.tables import GpuDenseTables, GpuTables
from ctxcache.decoder.gpu.table_stacks import stack_tables
from ctxcache.kernels.split_k_attention import region
from ctxcache.methods import Budget
from ctxcache.methods.csattention import CSAttention, CSAttentionParams


def _overlap(a: torch.Tensor, b: torch.Tensor) -> float:
    return len(set(a.tolist()) & set(b.tolist())) / max(1, b.numel())


def _stream_then_select(sel, tables, q, k, n, streamed, budget, device):
    """Insert the streamed keys k[:, n:n + streamed] into the GPU tables, then select for q (one
    batch element): (indices [Hkv, K] on the CPU, K as a device tensor)."""
    for t in range(streamed):
        tables.insert(k[None, :, n + t].to(device), torch.tensor([n + t], dtype=torch.int32, device=device),
                      sel.perm)
    total = n + streamed
    nt = torch.tensor([total], dtype=torch.int32, device=device)
    lo_t, hi_t = region(nt, budget.sinks, budget.recent)
    kk = torch.tensor([budget.top_k(total)], dtype=torch.int32, device=device)
    return sel.select(q[None].to(device), tables, lo_t, hi_t, kk)[0].cpu(), kk


@pytest.mark.parametrize("layout,weighting,scoring,routing", [("contiguous", "qnorm", "relative", "head"),
                                                              ("rope_pairs", "unit", "absolute", "head"),
                                                              ("contiguous", "qnorm", "expected", "head"),
                                                              ("contiguous", "qnorm", "expected", "group")])
def test_selection_matches_csattention_search(device, layout, weighting, scoring, routing):
    hq, hkv, d, n, streamed = 6, 2, 32, 600, 5
    params = CSAttentionParams(subspaces=4, centroids=16, kmeans_iters=3, list_fraction=0.25, rerank=1.0, layout=layout, weighting=weighting,
                               scoring=scoring, routing=routing)
    method = CSAttention(params)
    q_pre, k, v = torch.randn(hq, n, d), torch.randn(hkv, n + streamed, d), torch.randn(hkv, n + streamed, d)
    q = torch.randn(hq, d)
    k[:, n] = 4 * q.view(hkv, -1, d).sum(1)  # a streamed key the query should find
    state = method.open(method.build(q_pre, k[:, :n], v[:, :n]))
    method.append(state, k[:, n:n + streamed], n)
    budget = Budget(keep=0.05, sinks=4, recent=2)  # streamed keys fall in the searched region
    total = n + streamed
    lo, hi = budget.region(total)
    want = method.search(state, q, k, lo, hi, budget.top_k(total))

    sel = GpuSelector(params, 1, hq, hkv, d, total, budget.top_k(total), device)
    tables = GpuTables.stack([state.tables], [n], max_new=8, device=device)
    got, kk = _stream_then_select(sel, tables, q, k, n, streamed, budget, device)
    assert ((got[:, :kk[0]] == n).sum(1) == 1).all()  # the aligned streamed key is selected by every head
    for h in range(hkv):
        assert _overlap(got[h], want[h]) >= 0.97  # fp sums in another order may swap near-ties


@pytest.mark.parametrize("layout,score_dtype,routing,score_keys", [
    ("contiguous", "float16", "head", "fp32"), ("rope_pairs", "float16", "head", "fp16"),
    ("contiguous", "int8", "head", "fp16"), ("contiguous", "float16", "group", "fp16"),
    ("rope_pairs", "float16", "group", "fp32"), ("contiguous", "built-int8", "group", "fp16"),
    ("rope_pairs", "built-int8", "head", "fp16")])
def test_dense_selection_matches_csattention_search(device, layout, score_dtype, routing, score_keys):
    """Dense full-list tables (the default layout): GPU selection vs CSAttention.search.
    "int8": fp16 tables quantized on the GPU only; "built-int8": CSAttention table_dtype="int8"
    (both paths run the same integer estimate)."""
    hq, hkv, d, n, streamed = 6, 2, 32, 600, 5
    built8 = score_dtype == "built-int8"
    params = CSAttentionParams(subspaces=4, centroids=16, kmeans_iters=3, layout=layout, rerank=1.0, routing=routing,
                               table_dtype="int8" if built8 else "float16")
    method = CSAttention(params)
    q_pre, k, v = torch.randn(hq, n, d), torch.randn(hkv, n + streamed, d), torch.randn(hkv, n + streamed, d)
    q = torch.randn(hq, d)
    k[:, n + 1] = 4 * q.view(hkv, -1, d).sum(1)  # a streamed key the query should find
    state = method.open(method.build(q_pre, k[:, :n], v[:, :n]))
    assert "dense_score" in state.tables and ("dense_scale" in state.tables) == built8
    method.append(state, k[:, n:n + streamed], n)
    budget = Budget(keep=0.05, sinks=4, recent=2)
    total = n + streamed
    lo, hi = budget.region(total)
    want = method.search(state, q, k, lo, hi, budget.top_k(total))

    sel = GpuSelector(params, 1, hq, hkv, d, total, budget.top_k(total), device, score_keys=score_keys)
    tables = stack_tables([state.tables], [n], max_new=8, device=device, score_dtype="float16" if built8 else score_dtype)
    assert isinstance(tables, GpuDenseTables)
    assert tables.dense_score.shape[-1] == 608  # padded to whole 16-key runs (vector loads)
    got, kk = _stream_then_select(sel, tables, q, k, n, streamed, budget, device)
    assert ((got[:, :kk[0]] == n + 1).sum(1) == 1).all()
    # fp16: only summation order (and with fp16 keys, rounding ties) differs; int8 storage (0.4%
    # of a row's range) may swap near-ties
    floor = 0.85 if score_dtype == "int8" else 0.97
    for h in range(hkv):
        assert _overlap(got[h, :kk[0]], want[h]) >= floor


def test_selector_refuses_backoff(device):
    with pytest.raises(ValueError, match="backoff"):
        GpuSelector(CSAttentionParams(backoff_cos=0.5), 1, 4, 2, 32, 64, 8, device)


def test_selector_refuses_rows_the_radix_walk_cannot_count(device):
    from ctxcache.kernels.topk import MAX_ROW

    with pytest.raises(ValueError, match="fewer than"):
        GpuSelector(CSAttentionParams(rerank=1.0), 1, 4, 2, 16, MAX_ROW, 10, device)


def test_the_route_launch_zeroes_the_rerank_workspace_it_shares(device):
    """zero_with_route: the selector's and the re-rank's workspaces in one buffer, which the dense
    layout's route launch zeroes; the selection is the one a selector of its own makes, and the
    re-rank's dirtied workspace is zero again after the next route (the re-rank no longer zeroes it)."""
    from ctxcache.kernels.rerank import Reranker

    hq, hkv, d, n = 4, 2, 32, 600
    params = CSAttentionParams(subspaces=4, centroids=16, kmeans_iters=3, rerank=1.0, routing="group")
    method = CSAttention(params)
    state = method.open(method.build(torch.randn(hq, n, d), torch.randn(hkv, n, d), torch.randn(hkv, n, d)))
    budget = Budget(keep=0.05, sinks=4, recent=2)
    tables = stack_tables([state.tables], [n], max_new=8, device=device)
    nt = torch.tensor([n], dtype=torch.int32, device=device)
    lo, hi = region(nt, budget.sinks, budget.recent)
    kk = torch.tensor([budget.top_k(n)], dtype=torch.int32, device=device)
    q = torch.randn(1, hq, d, device=device)
    alone = GpuSelector(params, 1, hq, hkv, d, n, budget.top_k(n), device)
    want = alone.select(q, tables, lo, hi, kk).clone()
    shared = GpuSelector(params, 1, hq, hkv, d, n, budget.top_k(n), device)
    rr = Reranker(1, hkv, hq // hkv, 4 * budget.top_k(n), budget.top_k(n), device, follow=4)
    shared.zero_with_route(rr)
    assert rr.zeroed_before and rr.ws_pair.data_ptr() == shared.zero.data_ptr() + 4 * shared.ws.numel()
    for _ in range(2):
        rr.ws_pair.fill_(7)  # what a re-rank leaves behind
        assert torch.equal(shared.select(q, tables, lo, hi, kk), want)
        assert int(rr.ws_pair.abs().sum()) == 0
