"""Route, scatter, streamed gains and radix Top-K against their torch references."""

import pytest
import torch
import torch.nn.functional as F

from ctxcache.kernels.route import route, route_ref
from ctxcache.kernels.scatter import scatter_lists, scatter_ref
from ctxcache.kernels.stream import add_streamed, add_streamed_ref, span_insert, stream_insert, stream_scores_ref
from ctxcache.kernels.topk import keys16_ref, radix_topk, topk_ref


def as_u16(keys: torch.Tensor) -> torch.Tensor:
    """int32 keys in [0, 65536) -> a uint16 tensor (through int16: wraps, then reinterprets)."""
    return keys.to(torch.int16).view(torch.uint16)


def _tables(b, hkv, m, c, db, n, l, device):
    cent = F.normalize(torch.randn(b, hkv, m, c, db), dim=-1).half()
    top = torch.topk(torch.randn(b, hkv, m, c, n), l, dim=-1)
    return [t.to(device) for t in (cent, top.indices.int(), top.values.half(),
                                    top.values[..., -1].half().contiguous())]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_route_matches_reference(device, dtype):
    r, hq, hkv, m, c, db = 3, 6, 2, 4, 13, 8  # awkward: C and group not powers of two
    q = torch.randn(r, hq, m * db, dtype=dtype, device=device)
    cent = F.normalize(torch.randn(r, hkv, m, c, db), dim=-1).half().to(device)
    ids, w = route(q, cent)
    ids_ref, w_ref = route_ref(q, cent)
    assert (ids == ids_ref).float().mean() >= 0.99  # fp near-ties may differ
    torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-5)


def test_route_group_sums_the_query_heads(device):
    r, hq, hkv, m, c, db = 2, 6, 2, 4, 13, 8
    q = torch.randn(r, hq, m * db, device=device)
    cent = F.normalize(torch.randn(r, hkv, m, c, db), dim=-1).half().to(device)
    ids, w = route(q, cent, group=True)
    ids_ref, w_ref = route_ref(q, cent, group=True)
    assert ids.shape == (r, hkv, m) == w.shape
    assert (ids == ids_ref).float().mean() >= 0.99
    torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-5)
    # the group sum is not any single head's route
    torch.testing.assert_close(w_ref, q.view(r, hkv, -1, m, db).sum(2).norm(dim=-1))


def test_route_rejects_mismatched_shapes(device):
    with pytest.raises(ValueError, match="does not match"):
        route(torch.randn(1, 4, 32, device=device), torch.randn(1, 2, 4, 8, 16, device=device).half())


@pytest.mark.parametrize("relative", [True, False])
def test_scatter_matches_reference(device, relative):
    b, hq, hkv, m, c, db, n, l = 2, 6, 2, 4, 11, 8, 301, 77
    cent, li, ls, lf = _tables(b, hkv, m, c, db, n, l, device)
    ids = torch.randint(0, c, (b, hq, m), dtype=torch.int32, device=device)
    ids[:, 1] = ids[:, 0]  # two heads of a group share lists: exercises the merge
    w = torch.rand(b, hq, m, device=device)
    acc = torch.zeros(b, hkv, n, device=device)
    scatter_lists(ids, w, li, ls, lf, acc, relative, block_l=32)
    torch.testing.assert_close(acc, scatter_ref(ids, w, li, ls, lf, n, relative), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("ties", [False, True])
def test_radix_topk_matches_topk(device, ties):
    b, hkv, n = 2, 3, 1823
    x = torch.randint(0, 7, (b, hkv, n)).float() if ties else torch.randn(b, hkv, n)
    x[0, 0, 100:200] = 0.0
    x[0, 0, 150] = -0.0  # -0 and +0 are the same value
    x = x.to(device)
    lo = torch.tensor([4, 0], dtype=torch.int32, device=device)
    hi = torch.tensor([n - 32, 900], dtype=torch.int32, device=device)
    k = torch.tensor([92, 45], dtype=torch.int32, device=device)
    out = torch.full((b, hkv, 92), -1, dtype=torch.int32, device=device)
    radix_topk(x, lo, hi, k, out, block=256)
    refs = topk_ref(x.view(b * hkv, n), lo.repeat_interleave(hkv), hi.repeat_interleave(hkv),
                    k.repeat_interleave(hkv))
    for r in range(b * hkv):
        kk, lo_r, hi_r = int(k[r // hkv]), int(lo[r // hkv]), int(hi[r // hkv])
        got = out.view(b * hkv, -1)[r, :kk].long()
        assert got.unique().numel() == kk and lo_r <= int(got.min()) and int(got.max()) < hi_r
        row = x.view(b * hkv, n)[r]
        # same multiset of values as torch.topk (ties may pick different indices)
        torch.testing.assert_close(row[got].sort().values, row[refs[r]].sort().values, rtol=0, atol=0)


def test_stream_insert_and_gain(device):
    b, hq, hkv, m, c, db, t_max = 2, 4, 2, 4, 9, 8, 5
    cent, _, _, lf = _tables(b, hkv, m, c, db, 50, 10, device)
    new = torch.full((b, hkv, m, c, t_max), float("nan"), device=device)
    keys = torch.randn(3, b, hkv, m * db, device=device)
    start = torch.tensor([40, 41], dtype=torch.int32, device=device)
    count = torch.zeros(b, dtype=torch.int32, device=device)
    for t in range(3):
        stream_insert(keys[t], cent, new, start + t, start, count)
        torch.testing.assert_close(new[..., t], stream_scores_ref(keys[t], cent), rtol=1e-5, atol=1e-5)
        assert count.tolist() == [t + 1, t + 1]
    ids = torch.randint(0, c, (b, hq, m), dtype=torch.int32, device=device)
    w = torch.rand(b, hq, m, device=device)
    count = torch.tensor([3, 2], dtype=torch.int32, device=device)
    acc = torch.randn(b, hkv, 50, device=device)
    offset = lf - torch.rand_like(lf.float()).half()  # e.g. the mean score of unlisted keys
    want = add_streamed_ref(ids.cpu(), w.cpu(), new.cpu(), lf.cpu(), count.cpu(), start.cpu(),
                            acc.cpu().clone(), offset.cpu())
    add_streamed(ids, w, new, lf, count, start, acc, offset, block_t=2)
    torch.testing.assert_close(acc.cpu(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["contiguous", "rope_pairs"])
def test_stream_insert_reads_the_key_from_the_cache(device, layout):
    """From a layer's cache [B, Hkv, S, D] at pos[b], with the layout's dim order: the same
    scores as gathering and permuting the key first, in the right column, count raised."""
    from ctxcache.methods.csattention_refs import subspace_permutation
    b, hkv, m, c, db, s = 2, 3, 4, 9, 8, 20
    cent, _, _, _ = _tables(b, hkv, m, c, db, 50, 10, device)
    cache = torch.randn(b, hkv, s, m * db, device=device).to(torch.bfloat16)
    perm = subspace_permutation(m * db, m, layout).to(device)
    pos = torch.tensor([17, 12], dtype=torch.int32, device=device)
    start = torch.tensor([15, 10], dtype=torch.int32, device=device)
    count = torch.tensor([1, 3], dtype=torch.int32, device=device)  # row 1 already covers column 2
    new = torch.full((b, hkv, m, c, 4), float("nan"), device=device)
    stream_insert(cache, cent, new, pos, start, count, None if layout == "contiguous" else perm)
    key = cache[torch.arange(b), :, pos.long()][..., perm]  # [B, Hkv, D]
    want = stream_scores_ref(key, cent)
    for r in range(b):
        torch.testing.assert_close(new[r, ..., int(pos[r] - start[r])], want[r], rtol=1e-4, atol=1e-4)
    assert count.tolist() == [3, 3]


def test_stream_insert_takes_a_column_of_a_prompt_step(device):
    """A one-row prompt step passes pos[:, t] of a [1, T] position tensor: a view whose stride is
    T but which is contiguous (one element); the insert must take it."""
    b, hkv, m, c, db, s, t_len = 1, 2, 4, 9, 8, 20, 5
    cent, _, _, _ = _tables(b, hkv, m, c, db, 50, 10, device)
    cache = torch.randn(b, hkv, s, m * db, device=device)
    pos = torch.arange(10, 10 + t_len, dtype=torch.int32, device=device)[None]  # [1, T]
    start = torch.tensor([10], dtype=torch.int32, device=device)
    count = torch.zeros(1, dtype=torch.int32, device=device)
    new = torch.full((b, hkv, m, c, t_len), float("nan"), device=device)
    for t in range(t_len):
        stream_insert(cache, cent, new, pos[:, t].contiguous(), start, count)
    want = stream_scores_ref(cache[0, :, 10:10 + t_len].transpose(0, 1), cent.expand(t_len, *cent.shape[1:]))
    torch.testing.assert_close(new[0].permute(3, 0, 1, 2), want, rtol=1e-4, atol=1e-4)
    assert count.tolist() == [t_len]


@pytest.mark.parametrize("layout,count0", [("contiguous", 0), ("rope_pairs", 0), ("contiguous", 50)])
def test_span_insert_scores_a_prompt_as_stream_insert_scores_each_key(device, layout, count0):
    """A prompt's span of 37 keys (33 real, 4 padding) at column 6 of a row's overlay: every
    column as stream_scores_ref of its key in the layout's dim order, the columns around it
    untouched, the count raised to 6 + 33 (kept where already past it)."""
    from ctxcache.methods.csattention_refs import subspace_permutation
    hkv, m, c, db, t_len, col = 3, 4, 9, 8, 37, 6
    cent = _tables(1, hkv, m, c, db, 50, 10, device)[0][0]  # [Hkv, m, C, d_b]
    keys = torch.randn(hkv, t_len + 5, m * db, device=device).to(torch.bfloat16)[:, 2:2 + t_len]
    perm = subspace_permutation(m * db, m, layout).to(device)
    new = torch.full((hkv, m, c, 64), float("nan"), device=device)
    count = torch.tensor([count0], dtype=torch.int32, device=device)
    span_insert(keys, cent, new, col, count, torch.tensor([33], dtype=torch.int32, device=device),
                None if layout == "contiguous" else perm)
    want = stream_scores_ref(keys.transpose(0, 1)[..., perm], cent.expand(t_len, *cent.shape))  # [T, Hkv, m, C]
    torch.testing.assert_close(new[..., col:col + t_len].permute(3, 0, 1, 2), want, rtol=1e-5, atol=1e-5)
    assert torch.isnan(new[..., :col]).all() and torch.isnan(new[..., col + t_len:]).all()
    assert count.tolist() == [max(count0, col + 33)]


def test_span_insert_refuses_a_span_past_the_overlay(device):
    cent = _tables(1, 2, 4, 9, 8, 50, 10, device)[0][0]
    with pytest.raises(ValueError, match="disagree"):
        span_insert(torch.randn(2, 10, 32, device=device), cent, torch.zeros(2, 4, 9, 12, device=device), 4,
                    torch.zeros(1, dtype=torch.int32, device=device), torch.tensor([10], dtype=torch.int32, device=device))


def test_keys16_order_matches_fp16_values():
    x = torch.tensor([-3e5, -2.0, -1e-8, -0.0, 0.0, 1e-8, 0.5, 0.5004, 2.0, 7e4])
    keys = keys16_ref(x)
    assert (keys.diff() >= 0).all() and keys[3] == keys[4]  # -0 == +0
    assert keys[6] < keys[7]  # 0.5 and 0.5004 differ in fp16 (ulp 2.4e-4 there)
    vals = x.half().float()
    order = torch.argsort(vals, stable=True)
    assert torch.equal(torch.argsort(keys, stable=True), order)


@pytest.mark.parametrize("ties", [False, True])
def test_radix_topk_on_16bit_keys(device, ties):
    """Two passes over uint16 keys pick the k largest keys (ties: any of the equal ones)."""
    b, hkv, n = 2, 3, 1823
    x = torch.randint(0, 7, (b, hkv, n)).float() if ties else torch.randn(b, hkv, n) * 30
    keys = keys16_ref(x)
    lo = torch.tensor([4, 0], dtype=torch.int32, device=device)
    hi = torch.tensor([n - 32, 900], dtype=torch.int32, device=device)
    k = torch.tensor([92, 45], dtype=torch.int32, device=device)
    out = torch.full((b, hkv, 92), -1, dtype=torch.int32, device=device)
    radix_topk(as_u16(keys).to(device), lo, hi, k, out, block=256)
    flat = keys.view(b * hkv, n).float()
    refs = topk_ref(flat, lo.repeat_interleave(hkv), hi.repeat_interleave(hkv), k.repeat_interleave(hkv))
    for r in range(b * hkv):
        kk, lo_r, hi_r = int(k[r // hkv]), int(lo[r // hkv]), int(hi[r // hkv])
        got = out.view(b * hkv, -1)[r, :kk].long().cpu()
        assert got.unique().numel() == kk and lo_r <= int(got.min()) and int(got.max()) < hi_r
        assert torch.equal(flat[r][got].sort().values, flat[r][refs[r]].sort().values)


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("hist0_done", [False, True])
@pytest.mark.parametrize("block,warps", [(512, 4), (4096, 8)])  # 4096 / 8: the selector's batch-1 shape
def test_radix_topk_16bit_is_exact_and_deterministic(device, ties, hist0_done, block, warps):
    """Over 16-bit keys: the k largest keys, ties to the lowest indices (every run the same set),
    with pass 0 done here or added beforehand as the score kernel does."""
    from ctxcache.kernels.topk import _BINS, blocks16, topk16_ref, workspace

    b, hkv, n = 2, 3, 5000
    x = torch.randint(0, 7, (b, hkv, n)).float() if ties else torch.randn(b, hkv, n) * 30
    keys = keys16_ref(x)
    lo = torch.tensor([4, 0], dtype=torch.int32)
    hi = torch.tensor([n - 32, 2900], dtype=torch.int32)
    k = torch.tensor([250, 45], dtype=torch.int32)
    ws = workspace(b * hkv, "cpu", blocks16(n, block))
    if hist0_done:
        for r in range(b * hkv):  # pass 0 over [lo, hi), as dense_scores adds it
            seg = keys.view(b * hkv, n)[r, int(lo[r // hkv]):int(hi[r // hkv])]
            ws[r, :_BINS] = torch.bincount(seg >> 8, minlength=_BINS).int()
    out = torch.full((b, hkv, 250), -1, dtype=torch.int32, device=device)
    radix_topk(as_u16(keys).to(device), lo.to(device), hi.to(device), k.to(device), out, ws.to(device),
               block=block, hist0_done=hist0_done, num_warps=warps)
    refs = topk16_ref(keys.view(b * hkv, n), lo.repeat_interleave(hkv), hi.repeat_interleave(hkv),
                      k.repeat_interleave(hkv))
    for r in range(b * hkv):
        got = out.view(b * hkv, -1)[r, :int(k[r // hkv])].long().cpu()
        assert torch.equal(got.sort().values, refs[r])


@pytest.mark.parametrize("hist0_done", [False, True])
def test_radix_topk_16bit_with_k_zero_writes_nothing(device, hist0_done):
    """A row with k = 0 over a non-empty [lo, hi) selects nothing: its out row stays as it was,
    and the other row is still exact (keys include 0, the lowest code)."""
    from ctxcache.kernels.topk import _BINS, blocks16, topk16_ref, workspace

    b, hkv, n, block = 2, 2, 3000, 512
    keys = keys16_ref(torch.randn(b, hkv, n) * 30)
    keys[:, :, ::7] = 0
    lo = torch.tensor([4, 0], dtype=torch.int32)
    hi = torch.tensor([n - 32, 2000], dtype=torch.int32)
    k = torch.tensor([0, 60], dtype=torch.int32)
    ws = workspace(b * hkv, "cpu", blocks16(n, block))
    if hist0_done:
        for r in range(b * hkv):
            seg = keys.view(b * hkv, n)[r, int(lo[r // hkv]):int(hi[r // hkv])]
            ws[r, :_BINS] = torch.bincount(seg >> 8, minlength=_BINS).int() * int(k[r // hkv] > 0)
    out = torch.full((b, hkv, 60), -1, dtype=torch.int32, device=device)
    radix_topk(as_u16(keys).to(device), lo.to(device), hi.to(device), k.to(device), out, ws.to(device),
               block=block, hist0_done=hist0_done)
    assert (out[0] == -1).all()
    refs = topk16_ref(keys[1], lo[1:].repeat(hkv), hi[1:].repeat(hkv), k[1:].repeat(hkv))
    for h in range(hkv):
        assert torch.equal(out[1, h].long().cpu().sort().values, refs[h])


def test_radix_topk_refuses_rows_its_walk_cannot_count(device):
    from ctxcache.kernels.topk import MAX_ROW

    keys = torch.zeros(1, 1, MAX_ROW, dtype=torch.int16, device=device).view(torch.uint16)
    one = torch.ones(1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="radix walk"):
        radix_topk(keys, one * 0, one * MAX_ROW, one, torch.zeros(1, 1, 1, dtype=torch.int32, device=device))


def test_radix_topk_16bit_keeps_writes_in_bounds_on_a_wrong_pass0(device):
    """A pass-0 histogram that disagrees with the keys (here: all keys claimed by one bin) makes
    the threshold wrong, but the collect still writes no slot at or past k; a good row beside it
    stays exact."""
    from ctxcache.kernels.topk import _BINS, blocks16, topk16_ref, workspace

    n, k, block = 5000, 10, 512
    keys = torch.randint(0, 1 << 16, (2, 1, n), dtype=torch.int32)
    lo, hi = torch.zeros(2, dtype=torch.int32), torch.full((2,), n, dtype=torch.int32)
    kk = torch.full((2,), k, dtype=torch.int32)
    ws = workspace(2, "cpu", blocks16(n, block))
    ws[0, 200] = n  # wrong: "every key's top byte is 200"
    ws[1, :_BINS] = torch.bincount(keys[1, 0] >> 8, minlength=_BINS).int()
    buf = torch.full((2, 1, 2000), -1, dtype=torch.int32, device=device)
    radix_topk(as_u16(keys).to(device), lo.to(device), hi.to(device), kk.to(device), buf[..., :k], ws.to(device),
               block=block, hist0_done=True)
    assert (buf[:, :, k:] == -1).all()
    assert torch.equal(buf[1, 0, :k].long().cpu().sort().values, topk16_ref(keys[1], lo[1:], hi[1:], kk[1:])[0])


def test_radix_topk_16bit_needs_block_histograms(device):
    from ctxcache.kernels.topk import workspace

    keys = torch.zeros(1, 1, 3000, dtype=torch.int16, device=device).view(torch.uint16)
    one = torch.ones(1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="block"):
        radix_topk(keys, one * 0, one * 3000, one * 10, torch.zeros(1, 1, 10, dtype=torch.int32, device=device),
                   workspace(1, device), block=1024, hist0_done=True)


def test_route_zeroes_a_side_buffer(device):
    """The route launch also zeroes the Top-K workspace (every element, none beyond it)."""
    q = torch.randn(2, 6, 32, device=device)
    cent = F.normalize(torch.randn(2, 2, 4, 13, 8), dim=-1).half().to(device)
    buf = torch.full((3 * 1000 + 7 + 5,), 7, dtype=torch.int32, device=device)
    ids, w = route(q, cent, group=True, zero=buf[:-5])
    assert int(buf[:-5].abs().sum()) == 0 and (buf[-5:] == 7).all()
    ids_ref, _ = route_ref(q, cent, group=True)
    assert (ids == ids_ref).float().mean() >= 0.99
