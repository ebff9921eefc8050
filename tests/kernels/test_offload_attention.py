"""Zero-copy host-KV attention with a GPU slot cache against torch references."""

import pytest
import torch

import copy

from ctxcache.host_copy import pinned_exact
from ctxcache.decoder.gpu.offload import OffloadAttention, SlotCache, plan_slots, plan_slots_ref
from ctxcache.kernels.offload_attention import offload_attention, offload_attention_ref
from ctxcache.kernels.split_k_attention import sparse_attention_ref

TOL = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2}


def _rel(out, ref):
    assert not torch.isnan(out).any()
    out, ref = out.double().cpu(), ref.double().cpu()  # host-KV references run on the CPU
    return ((out - ref).norm() / ref.norm()).item()


def _host(shape, dtype):
    t = pinned_exact(shape, dtype)  # pinned when a GPU exists: the kernel reads it zero-copy
    t.copy_(torch.randn(shape))
    return t


def _plan(b, hkv, kmax, cap, n_hit):
    """A valid slot plan: the first n_hit keys hit distinct slots, the rest miss into others."""
    slot = torch.empty(b, hkv, kmax, dtype=torch.int32)
    for i in range(b):
        for h in range(hkv):
            perm = torch.randperm(cap)
            slot[i, h, :n_hit] = perm[:n_hit].int()
            slot[i, h, n_hit:] = -perm[n_hit:kmax].int() - 1
    return slot


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 4])
def test_offload_matches_reference(device, dtype, splits):
    b, hq, hkv, s, d, kmax, cap = 2, 8, 2, 300, 32, 40, 48
    q = torch.randn(b, hq, d, dtype=dtype, device=device)
    kh, vh = _host((b, hkv, s, d), dtype), _host((b, hkv, s, d), dtype)
    n = torch.tensor([290, 120], dtype=torch.int32)
    idx = torch.stack([torch.stack([torch.randperm(80)[:kmax] + 4 for _ in range(hkv)]) for _ in range(b)]).int()
    k_sel = torch.tensor([40, 25], dtype=torch.int32)
    slot = _plan(b, hkv, kmax, cap, n_hit=15)
    kc = torch.randn(b, hkv, cap, d, dtype=dtype, device=device)
    vc = torch.randn_like(kc)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    ref = offload_attention_ref(q.double(), kh.double(), vh.double(), kc_ref, vc_ref, idx, slot, k_sel, n, 4, 16)
    out = offload_attention(q, kh, vh, kc, vc, idx.to(device), slot.to(device), k_sel.to(device), n.to(device),
                            4, 16, splits=splits, block_n=16)
    assert _rel(out, ref) < TOL[dtype]
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)  # misses landed in their slots


def test_padding_is_no_key_and_never_cached(device):
    """-1 in idx (a carried row's padding after its candidates, reselect): no key to attend, no
    cache slot written, whatever its slot entry says (plan_slots writes -1 there)."""
    b, hq, hkv, s, d, kmax, cap = 2, 8, 2, 300, 32, 40, 48
    q = torch.randn(b, hq, d, device=device)
    kh, vh = _host((b, hkv, s, d), torch.float32), _host((b, hkv, s, d), torch.float32)
    n = torch.tensor([290, 120], dtype=torch.int32)
    idx = torch.stack([torch.stack([torch.randperm(80)[:kmax] + 4 for _ in range(hkv)]) for _ in range(b)]).int()
    k_sel = torch.tensor([40, 25], dtype=torch.int32)
    slot = _plan(b, hkv, kmax, cap, n_hit=15)
    idx[0, 1, 28:] = -1
    idx[1, 0, 20:] = -1
    slot[idx < 0] = -1  # as the plan writes: a "miss into slot 0" the kernel must not act on
    kc = torch.randn(b, hkv, cap, d, device=device)
    vc = torch.randn_like(kc)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    ref = offload_attention_ref(q.double(), kh.double(), vh.double(), kc_ref, vc_ref, idx, slot, k_sel, n, 4, 16)
    out = offload_attention(q, kh, vh, kc, vc, idx.to(device), slot.to(device), k_sel.to(device), n.to(device),
                            4, 16, splits=4, block_n=16)
    assert _rel(out, ref) < TOL[torch.float32]
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)  # no slot written for the padding


def test_k_in_hbm_reads_k_from_its_buffer_and_caches_v_alone(device):
    """k_cache None (the offload runner with K in HBM): every K from k_host (here the GPU
    buffer), hits' V from the cache, misses' V written to their slots; equals the reference."""
    b, hq, hkv, s, d, kmax, cap = 2, 8, 2, 300, 32, 40, 48
    q = torch.randn(b, hq, d, device=device)
    kh = torch.randn(b, hkv, s, d, device=device)  # K in HBM
    vh = _host((b, hkv, s, d), torch.float32)
    n = torch.tensor([290, 120], dtype=torch.int32)
    idx = torch.stack([torch.stack([torch.randperm(80)[:kmax] + 4 for _ in range(hkv)]) for _ in range(b)]).int()
    k_sel = torch.tensor([40, 25], dtype=torch.int32)
    slot = _plan(b, hkv, kmax, cap, n_hit=15)
    vc = torch.randn(b, hkv, cap, d, device=device)
    vc_ref = vc.clone()
    ref = offload_attention_ref(q.double(), kh.double(), vh.double(), None, vc_ref, idx, slot, k_sel, n, 4, 16)
    out = offload_attention(q, kh, vh, None, vc, idx.to(device), slot.to(device), k_sel.to(device), n.to(device),
                            4, 16, splits=4, block_n=16)
    assert _rel(out, ref) < 1e-5
    assert torch.equal(vc.cpu(), vc_ref.cpu())  # misses' V landed in their slots
    # the cache's V for hits is what attention used: with K read from its buffer, a hit whose
    # cache slot holds the true V gives the dense-truth answer (as a hit with K and V cached did)
    vc2 = torch.zeros(b, hkv, cap, d, device=device)
    for i in range(b):
        for h in range(hkv):
            for j in range(15):
                vc2[i, h, int(slot[i, h, j])] = vh[i, h, int(idx[i, h, j])].to(device)
    truth = sparse_attention_ref(q.double().cpu(), kh.double().cpu(), vh.double(), idx, k_sel, n, 4, 16)
    out2 = offload_attention(q, kh, vh, None, vc2, idx.to(device), slot.to(device), k_sel.to(device), n.to(device),
                             4, 16, splits=2, block_n=16)
    assert _rel(out2, truth) < 1e-5


def test_hits_come_from_the_cache(device):
    """Hit rows are read from the GPU slots: garbage in their host rows changes nothing."""
    b, hq, hkv, s, d, kmax = 1, 4, 1, 200, 32, 20
    q = torch.randn(b, hq, d, device=device)
    kh, vh = _host((b, hkv, s, d), torch.float32), _host((b, hkv, s, d), torch.float32)
    n = torch.tensor([200], dtype=torch.int32)
    idx = (torch.randperm(150)[:kmax] + 10).int().view(1, 1, kmax)
    k_sel = torch.tensor([kmax], dtype=torch.int32)
    slot = _plan(b, hkv, kmax, kmax, n_hit=12)
    kc = torch.zeros(b, hkv, kmax, d, device=device)
    vc = torch.zeros_like(kc)
    hit_pos = idx[0, 0, :12].long()
    kc[0, 0, slot[0, 0, :12].long()] = kh[0, 0, hit_pos].to(device)
    vc[0, 0, slot[0, 0, :12].long()] = vh[0, 0, hit_pos].to(device)
    ref = sparse_attention_ref(q.double().cpu(), kh.double(), vh.double(), idx, k_sel, n, 4, 16)
    kh[0, 0, hit_pos] = 1e4
    vh[0, 0, hit_pos] = -1e4
    out = offload_attention(q, kh, vh, kc, vc, idx.to(device), slot.to(device), k_sel.to(device), n.to(device),
                            4, 16, splits=2, block_n=16)
    assert _rel(out, ref) < 1e-5


@pytest.mark.parametrize("block", [8, 1024])  # 8: several blocks per pass
@pytest.mark.parametrize("cap", [24, 160])  # 24: misses take last step's slots too; 160: the free list stops early
@pytest.mark.parametrize("padded", [False, True])  # a carried row's -1 padding at its list's end: no key
def test_plan_slots_keeps_cache_consistent(device, block, cap, padded):
    b, hkv, n_max, kmax = 2, 3, 100, 20
    c = SlotCache.empty(b, hkv, cap, n_max, 4, torch.float32, device)
    prev = None
    for step in range(6):
        idx = torch.stack([torch.stack([torch.randperm(40)[:kmax] for _ in range(hkv)]) for _ in range(b)]).int()
        k_sel = torch.tensor([kmax, 13 + step], dtype=torch.int32)
        if padded:
            for h in range(hkv):
                idx[0, h, kmax - 3 - h:] = -1
        shadow = copy.deepcopy(c)
        slot = plan_slots(c, idx.to(device), k_sel.to(device), block=block).cpu()
        slot_ref = plan_slots_ref(shadow, idx.to(device), k_sel.to(device)).cpu()
        for i in range(b):  # the kernel and the torch reference agree exactly on the valid entries
            assert torch.equal(slot[i, :, :int(k_sel[i])], slot_ref[i, :, :int(k_sel[i])])
        assert torch.equal(c.tag, shadow.tag) and torch.equal(c.slot_of, shadow.slot_of)
        assert int(c.hits) == int(shadow.hits) and int(c.selected) == int(shadow.selected)
        tag, slot_of = c.tag.cpu(), c.slot_of.cpu()
        for i in range(b):
            for h in range(hkv):
                kk = int((idx[i, h, :int(k_sel[i])] >= 0).sum())  # the padding after the keys
                assert (slot[i, h, kk:int(k_sel[i])] == -1).all()
                s = slot[i, h, :kk]
                used = torch.where(s >= 0, s, -s - 1)
                assert len(set(used.tolist())) == kk  # one slot per key, hits and misses disjoint
                for j in range(kk):
                    p = int(idx[i, h, j])
                    assert (int(s[j]) >= 0) == (prev is not None and p in prev[i][h])  # hit iff cached before
                    assert int(tag[i, h, int(used[j])]) == p and int(slot_of[i, h, p]) == int(used[j])
                held = {int(x) for x in tag[i, h] if x >= 0}
                assert held == {p for p in range(n_max) if slot_of[i, h, p] >= 0}
                assert all(int(tag[i, h, int(slot_of[i, h, p])]) == p for p in held)
        prev = [[set(int(x) for x in c.tag.cpu()[i, h] if x >= 0) for h in range(hkv)] for i in range(b)]


@pytest.mark.parametrize("use_kernel", [True, False])
def test_a_cache_of_two_selections_evicts_the_least_recently_used(device, use_kernel):
    """Capacity 2 K: keys selected two steps ago are still held, and a miss evicts keys no step
    used lately, not those hit last step (in slot order step 2's misses took step 1's slots)."""
    c = SlotCache.empty(1, 1, 8, 16, 4, torch.float32, device)
    k_sel = torch.tensor([4], dtype=torch.int32, device=device)
    plan = (lambda idx: plan_slots(c, idx, k_sel)) if use_kernel else (lambda idx: plan_slots_ref(c, idx, k_sel))
    hits = []
    for keys in ([0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3], [8, 9, 10, 11], [0, 1, 2, 3], [4, 5, 6, 7]):
        slot = plan(torch.tensor([[keys]], dtype=torch.int32, device=device)).cpu()
        hits.append(int((slot >= 0).sum()))
    # step 3's misses took 4-7's slots (unused since step 1), so 0-3 hit again and 4-7 miss
    assert hits == [0, 0, 4, 0, 4, 0]
    assert int(c.hits) == 8 and int(c.selected) == 24


class _FixedSelector:
    """Returns a preset selection (the selection kernels have their own tests)."""

    def __init__(self, idx):
        self.idx = idx

    def select(self, q, tables, lo, hi, k):
        return self.idx


class _Tables:
    def __init__(self, device):
        self.centroids = torch.zeros(1, device=device)


def test_offload_attention_steps_match_host_reference(device):
    """Over steps with overlapping selections, output equals attention over the host truth,
    and the hit counts are the overlaps."""
    b, hq, hkv, s, d, kmax = 1, 4, 2, 256, 32, 16
    kh, vh = _host((b, hkv, s, d), torch.float32), _host((b, hkv, s, d), torch.float32)
    base = torch.stack([torch.randperm(200)[:kmax + 8] + 20 for _ in range(hkv)])[None].int()
    sel = _FixedSelector(None)
    attn = OffloadAttention(sel, [_Tables(device)], [kh], [vh], sinks=4, recent=8, keep=kmax / s, k_max=kmax)
    n = torch.tensor([s], dtype=torch.int32, device=device)
    for step, shift in enumerate((0, 0, 4, 8)):
        idx = base[..., shift:shift + kmax].contiguous()
        sel.idx = idx.to(device)
        q = torch.randn(b, hq, d, device=device)
        out = attn(0, q, n)
        ref = sparse_attention_ref(q.double().cpu(), kh.double(), vh.double(), idx, n.cpu(), n.cpu(), 4, 8)
        assert _rel(out, ref) < 1e-5
    # hits: 0, then 16, then 12, then 12 per head (two heads)
    assert int(attn.caches[0].hits) == 2 * (16 + 12 + 12) and int(attn.caches[0].selected) == 2 * 4 * kmax


@pytest.mark.gpu(reason="CUDA graphs and pinned memory need a GPU")
def test_offload_step_graph_replays_match_reference():
    """The whole step (slot plan + zero-copy attention over pinned K/V) captured once and
    replayed with new selections matches attention over the host truth every time."""
    from ctxcache.kernels.timing import capture_graph as capture
    b, hq, hkv, s, d, kmax = 2, 8, 2, 4096, 128, 64
    kh, vh = _host((b, hkv, s, d), torch.bfloat16), _host((b, hkv, s, d), torch.bfloat16)
    sel = _FixedSelector(torch.zeros(b, hkv, kmax, dtype=torch.int32, device="cuda"))
    attn = OffloadAttention(sel, [_Tables("cuda")], [kh], [vh], sinks=4, recent=32, keep=kmax / s, k_max=kmax)
    n = torch.full((b,), s, dtype=torch.int32, device="cuda")
    q = torch.zeros(b, hq, d, dtype=torch.bfloat16, device="cuda")
    out = torch.zeros_like(q)
    g = capture(lambda: out.copy_(attn(0, q, n)))
    for step in range(4):
        idx = torch.stack([torch.stack([torch.randperm(128)[:kmax] + 100 for _ in range(hkv)]) for _ in range(b)]).int()
        sel.idx.copy_(idx)
        q.copy_(torch.randn(b, hq, d))
        g.replay()
        ref = sparse_attention_ref(q.double().cpu(), kh.double(), vh.double(), idx, n.cpu(), n.cpu(), 4, 32)
        assert _rel(out, ref) < TOL[torch.bfloat16]
    assert 0.0 < attn.hit_rate() < 1.0
