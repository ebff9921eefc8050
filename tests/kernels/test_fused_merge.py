"""Split-K attention merging its partials in the same launch (fused_merge) against the two-launch path.

Both paths run the same merge arithmetic (split_k_attention.merge_head) over the same partials,
so under the CPU interpreter (numpy reductions, whatever the launch shape) the outputs are equal
bit for bit. Compiled, the fused merge reduces inside the split kernel's 4 warps and the merge
kernel inside 1, so its sums may round differently: there the outputs agree to fp32 rounding.
The interpreter runs programs one after another (the last ticket is always the last split); the
ticket's memory ordering is checked in the sm_90 SASS (test_ptx_builds) and under concurrency by
the gpu test below."""

import pytest
import torch

from ctxcache.host_copy import pinned_exact
from ctxcache.kernels.offload_attention import offload_attention
from ctxcache.kernels.sync import compiled
from ctxcache.kernels.split_k_attention import partial_workspace, sparse_decode_attention

B, HKV, S, D, SINKS, RECENT = 2, 2, 333, 32, 4, 16


def _same(fused: torch.Tensor, two: torch.Tensor) -> None:
    assert not torch.isnan(fused).any()
    if compiled(fused):
        torch.testing.assert_close(fused, two, rtol=1e-5, atol=1e-6)
    else:
        assert torch.equal(fused, two), (fused - two).abs().max()


def _case(g: int, dense: bool, device: str, dtype: torch.dtype = torch.float32) -> tuple:
    """(q, k, v, n, idx, k_sel): a long row and a short one, so some splits hold no keys."""
    q = torch.randn(B, HKV * g, D, dtype=dtype, device=device)
    k = torch.randn(B, HKV, S, D, dtype=dtype, device=device)
    v = torch.randn_like(k)
    n = torch.tensor([321, 97], dtype=torch.int32, device=device)
    if dense:
        return q, k, v, n, None, None
    idx = torch.stack([torch.randperm(60)[:41] + SINKS for _ in range(B * HKV)]).view(B, HKV, 41).int().to(device)
    return q, k, v, n, idx, torch.tensor([41, 23], dtype=torch.int32, device=device)


def _attend(case: tuple, splits: int, fused: bool, ws=None) -> torch.Tensor:
    q, k, v, n, idx, k_sel = case
    out = torch.full_like(q, float("nan"))  # a row the fused merge skipped stays NaN
    return sparse_decode_attention(q, k, v, n, idx, k_sel, SINKS, RECENT, splits=splits, out=out, ws=ws,
                                   block_n=16, fused_merge=fused)


@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize("g", [4, 1])
@pytest.mark.parametrize("splits", [1, 4, 8])
def test_fused_merge_equals_two_launches(device, dense, g, splits):
    case = _case(g, dense, device)
    ws = partial_workspace(B, HKV * g, HKV, splits, D, device, counters=True)
    _same(_attend(case, splits, True, ws), _attend(case, splits, False))
    assert not ws[2].any()  # every row's last program reset its counter


def test_bf16_output_equals_two_launches(device):
    case = _case(4, False, device, torch.bfloat16)
    _same(_attend(case, 4, True), _attend(case, 4, False))


def test_counters_reset_so_a_second_call_merges_again(device):
    """The same workspace twice (as graph replays use it): without the reset, the second call's
    tickets would start at SPLITS, no program would merge and its output would stay NaN."""
    case = _case(4, False, device)
    ws = partial_workspace(B, 4 * HKV, HKV, 4, D, device, counters=True)
    first = _attend(case, 4, True, ws)
    second = _attend(case, 4, True, ws)
    assert not second.isnan().any() and torch.equal(first, second)
    other = _case(4, False, device)  # new inputs through the same counters: their own answer
    _same(_attend(other, 4, True, ws), _attend(other, 4, False))


def test_fused_merge_needs_counters(device):
    case = _case(4, True, device)
    ws = partial_workspace(B, 4 * HKV, HKV, 4, D, device)
    with pytest.raises(ValueError, match="counters=True"):
        _attend(case, 4, True, ws)


@pytest.mark.parametrize("k_hbm", [False, True])
def test_offload_fused_merge_equals_two_launches(device, k_hbm):
    """The host-KV attention's kernel takes the same ticket (its hits and misses both times)."""
    b, hq, hkv, s, d, kmax, cap = 2, 8, 2, 300, 32, 40, 48
    q = torch.randn(b, hq, d, device=device)
    kh, vh = pinned_exact((b, hkv, s, d), torch.float32), pinned_exact((b, hkv, s, d), torch.float32)
    kh.copy_(torch.randn(kh.shape))
    vh.copy_(torch.randn(vh.shape))
    idx = torch.stack([torch.randperm(80)[:kmax] + 4 for _ in range(b * hkv)]).view(b, hkv, kmax).int()
    slot = torch.stack([torch.randperm(cap)[:kmax] for _ in range(b * hkv)]).view(b, hkv, kmax).int()
    slot[..., 20:] = -slot[..., 20:] - 1  # the first 20 hit, the rest miss into their slots
    k_sel, n = torch.tensor([40, 25], dtype=torch.int32), torch.tensor([290, 120], dtype=torch.int32)
    kc = torch.randn(b, hkv, cap, d, device=device)
    vc = torch.randn_like(kc)
    outs = []
    for fused in (False, True):
        kc_i, vc_i = kc.clone(), vc.clone()  # each run starts from the same cache
        outs.append(offload_attention(q, kh, vh, None if k_hbm else kc_i, vc_i, idx.to(device), slot.to(device),
                                      k_sel.to(device), n.to(device), 4, 16, splits=4, block_n=16, fused_merge=fused))
    _same(outs[1], outs[0])


@pytest.mark.gpu
def test_fused_merge_graph_replays_on_the_gpu():
    """Compiled, many programs race for the tickets: every replay of a captured fused launch
    (Llama-3.1-8B's group, the runner's block) must agree with the two-launch answer."""
    g, splits = 4, 16
    case = _case(g, False, "cuda", torch.bfloat16)
    ws = partial_workspace(B, HKV * g, HKV, splits, D, "cuda", counters=True)
    out = torch.empty_like(case[0])
    q, k, v, n, idx, k_sel = case

    def fused():
        sparse_decode_attention(q, k, v, n, idx, k_sel, SINKS, RECENT, splits=splits, out=out, ws=ws,
                                block_n=16, fused_merge=True)
    fused()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused()
    want = _attend(case, splits, False)
    for _ in range(200):
        out.fill_(float("nan"))
        graph.replay()
        _same(out, want)
    assert not ws[2].any()
