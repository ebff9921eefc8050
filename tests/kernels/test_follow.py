"""CSAttention's follow on the GPU: the successor promotion (kernels/follow.py) against its torch
reference, through the radix Top-K that reads the histogram it edits; and the re-rank's best
candidates (Reranker's follow_out) against the reference's ordered re-rank."""

import pytest
import torch

from ctxcache.kernels.follow import TOP_KEY, promote_ref, promote_successors
from ctxcache.kernels.rerank import Reranker
from ctxcache.kernels.topk import blocks16, key16_codes, radix_topk, topk16_ref, workspace
from ctxcache.methods.csattention_refs import exact_rerank

from test_gpu_rerank import _rows


def _hist0(codes: torch.Tensor, ws: torch.Tensor, lo, hi, k) -> None:
    """Radix pass 0 of [lo, hi) into ws, as the selector's score kernels add it."""
    b, hkv, _ = codes.shape
    for r in range(b * hkv):
        bb = r // hkv
        if int(k[bb]) > 0:
            top = codes[bb, r % hkv, int(lo[bb]):int(hi[bb])] >> 8
            ws[r, :256] += torch.bincount(top, minlength=256).int().to(ws.device)


@pytest.mark.parametrize("block", [1024, 4096])
def test_promoted_successors_are_selected_first_and_the_histogram_stays_exact(device, block):
    gen = torch.Generator().manual_seed(0)
    b, hkv, n, f = 3, 2, 5000, 24
    codes = torch.randint(0, 0xFC00, (b, hkv, n), generator=gen, dtype=torch.int32)
    keys = codes.short().view(torch.uint16)  # int16 wraps: the same 16 bits
    lo, hi = torch.tensor([4, 4, 0], dtype=torch.int32), torch.tensor([4990, 3000, 0], dtype=torch.int32)
    k = torch.tensor([100, 30, 0], dtype=torch.int32)
    # previous keys: distinct, some at the region's end (successor outside), some -1
    prev = torch.stack([torch.randperm(n - 1, generator=gen)[:f] for _ in range(b * hkv)]).view(b, hkv, f).int()
    prev[0, 0, :3] = torch.tensor([4989, 3, -1], dtype=torch.int32)
    prev[1, 1, 5:] = -1
    want_codes = promote_ref(keys, prev, lo, hi, k)
    promoted = (want_codes == TOP_KEY).sum(-1)
    assert int(promoted[0, 0]) < f and int(promoted[2].sum()) == 0  # the bounds and k = 0 were tested
    dev = [t.to(device) for t in (keys, prev, lo, hi, k)]
    kd, pd, lod, hid, k_d = dev
    ws = workspace(b * hkv, device, blocks16(n, block))
    _hist0(key16_codes(keys), ws, lo, hi, k)
    promote_successors(kd, ws, pd, lod, hid, k_d)
    assert torch.equal(key16_codes(kd.cpu()), want_codes)
    want_ws = workspace(b * hkv, "cpu", blocks16(n, block))
    _hist0(want_codes, want_ws, lo, hi, k)
    assert torch.equal(ws.cpu()[:, :256], want_ws[:, :256])
    out = torch.full((b, hkv, int(k.max())), -1, dtype=torch.int32, device=device)
    radix_topk(kd, lod, hid, k_d, out, ws, block=block, hist0_done=True)
    want = topk16_ref(want_codes.view(b * hkv, n), lo.repeat_interleave(hkv), hi.repeat_interleave(hkv),
                      k.repeat_interleave(hkv))
    for r in range(b * hkv):
        got = out.view(b * hkv, -1)[r, :int(k[r // hkv])].cpu().sort().values
        assert torch.equal(got, want[r].int()), r


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rerank_writes_its_best_candidates_for_the_next_step(device, dtype):
    rows = _rows(torch.Generator().manual_seed(1), dtype)
    q, keys, cand, n, lo, hi, k, kc, sinks, recent = rows
    f = 8
    kf = k.clamp(max=f).int()
    rr = Reranker(q.shape[0], keys.shape[1], q.shape[1] // keys.shape[1], cand.shape[2] - 5, int(k.max()), device,
                  programs=12, follow=f)
    follow_out = torch.zeros(q.shape[0], keys.shape[1], f, dtype=torch.int32, device=device)
    dev = [t.to(device) for t in (q, keys, cand)] + [t.int().to(device) for t in (kc, k, lo, hi, n, kf)]
    qd, kd, cd, kcd, k32, lod, hid, nd, kfd = dev
    rr(qd, kd, cd, kcd, k32, lod, hid, nd, sinks, recent, follow_out, kfd)
    got = follow_out.cpu()
    for r in range(q.shape[0]):
        nr, kr, fr = int(n[r]), int(k[r]), int(kf[r])
        others = torch.cat([torch.arange(int(lo[r])), torch.arange(int(hi[r]), nr)]).expand(keys.shape[1], -1)
        best = exact_rerank(q[r], keys[r, :, :nr], cand[r, :, :int(kc[r])].long(), kr, others, ordered=True)[:, :fr]
        assert (got[r, :, fr:] == -1).all()
        for h in range(keys.shape[1]):
            same = set(got[r, h, :fr].tolist()) & set(best[h].tolist())
            # bf16: 16-bit keys of the log-probabilities, so a near-tie at the f-th may swap
            assert len(same) >= fr - (0 if dtype == torch.float32 else 1), (r, h)


def test_steps_with_follow_select_what_csattention_search_selects(device):
    """The prompt's seed, then steps of promotion, re-rank and update (GpuDenseTables.seed_follow,
    GpuSelector.select, Reranker's follow_out) against CSAttention.observe_dense and .search on
    the same int8 tables: the same keys each step (fp32 re-rank: the reference's order)."""
    from ctxcache.decoder.gpu.selector import GpuSelector
    from ctxcache.decoder.gpu.tables import follow_state
    from ctxcache.decoder.gpu.table_stacks import stack_tables
    from ctxcache.methods import Budget
    from ctxcache.methods.csattention import CSAttention, CSAttentionParams

    gen = torch.Generator().manual_seed(2)
    hq, hkv, d, n, f = 8, 2, 32, 600, 8
    params = CSAttentionParams(subspaces=4, centroids=16, kmeans_iters=3, routing="group", table_dtype="int8",
                               rerank=4.0, follow=f, reselect=1)  # every step selects (test_csattention_reselect)
    method = CSAttention(params)
    q_pre, k, v = (torch.randn(hq, n, d, generator=gen), torch.randn(hkv, n, d, generator=gen),
                   torch.randn(hkv, n, d, generator=gen))
    state = method.open(method.build(q_pre, k, v))
    budget = Budget(keep=0.05, sinks=4, recent=8)
    lo, hi = budget.region(n)
    top_k, kc_n = budget.top_k(n), params.candidates(budget.top_k(n), hi - lo)
    method.observe_dense(state, q_pre[:, -1], k, lo, hi)

    sel = GpuSelector(params, 1, hq, hkv, d, n, kc_n, device)
    tables = stack_tables([state.tables], [n], max_new=8, device=device)
    tables.follow_prev = follow_state(1, hkv, f, device)
    tables.seed_follow(0, q_pre[:, -1].to(device), k.to(device), budget)
    rr = Reranker(1, hkv, hq // hkv, kc_n, top_k, device, programs=4, follow=f)
    lens = [torch.tensor([x], dtype=torch.int32, device=device) for x in (lo, hi, top_k, kc_n, n, min(f, top_k))]
    lo_d, hi_d, k_d, kc_d, n_d, kf_d = lens
    keys = k[None].to(device)
    changed = False
    for step in range(4):
        prev = tables.follow_prev.cpu().clone()
        assert [set(p.tolist()) for p in prev[0]] == [set(p.tolist()) for p in state.extra["follow_prev"]], step
        q = torch.randn(hq, d, generator=gen)
        want = method.search(state, q, k, lo, hi, top_k)
        plain = sel.select(q[None].to(device), stack_tables([state.tables], [n], 8, device), lo_d, hi_d, kc_d).clone()
        cand = sel.select(q[None].to(device), tables, lo_d, hi_d, kc_d)  # the same static buffer: second
        changed |= any(set(a[:kc_n].tolist()) != set(b[:kc_n].tolist()) for a, b in zip(cand[0].cpu(), plain[0].cpu()))
        succ = (prev[0] + 1).tolist()
        for h in range(hkv):  # every successor inside the region is a candidate
            assert {s for s in succ[h] if lo <= s < hi} <= set(cand[0, h, :kc_n].tolist()), (step, h)
        got = rr(q[None].to(device), keys, cand, kc_d, k_d, lo_d, hi_d, n_d, budget.sinks, budget.recent,
                 tables.follow_prev, kf_d)
        for h in range(hkv):
            assert set(got[0, h, :top_k].tolist()) == set(want[h].tolist()), (step, h)
    assert changed  # the promotion moved candidates: this test saw follow at work


def test_a_padded_prompt_seeds_what_its_real_tokens_seed(device):
    """seed_follow over a prompt padded to its graph's length (SeedPadding: device bounds, the
    padding's keys masked) picks the unpadded prompt's keys, even where one query head's whole
    attention would go to the padding."""
    from ctxcache.decoder.gpu.tables import follow_state
    from ctxcache.decoder.gpu.table_stacks import stack_tables
    from ctxcache.decoder.gpu.slot_prefill import SeedPadding
    from ctxcache.methods import Budget
    from ctxcache.methods.csattention import CSAttention, CSAttentionParams

    gen = torch.Generator().manual_seed(5)
    hq, hkv, d, n, f, real, padded = 8, 2, 32, 600, 8, 5, 16
    params = CSAttentionParams(subspaces=4, centroids=16, kmeans_iters=3, routing="group", table_dtype="int8",
                               rerank=4.0, follow=f, reselect=1)  # every step selects (test_csattention_reselect)
    q, k = torch.randn(hq, n, d, generator=gen), torch.randn(hkv, n, d, generator=gen)
    state = CSAttention(params).open(CSAttention(params).build(q, k, k))
    budget = Budget(keep=0.05, sinks=4, recent=8)
    seeds = []
    for keys, padding in ((k, None), (torch.cat([k, 40 * q[None, 0, -1].expand(hkv, padded - real, d)], 1), True)):
        tables = stack_tables([state.tables], [n - real], max_new=32, device=device)
        tables.follow_prev = follow_state(1, hkv, f, device)
        if padding:
            count = torch.tensor([real], dtype=torch.int32, device=device)
            padding = SeedPadding.of(n - real, count, padded, budget, f)
        tables.seed_follow(0, q[:, -1].to(device), keys.to(device), budget, padding)
        seeds.append([set(row.tolist()) for row in tables.follow_prev[0].cpu()])
    assert seeds[0] == seeds[1]
