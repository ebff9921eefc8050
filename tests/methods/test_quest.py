"""Quest: the page bound really bounds q.k, pages are taken whole in bound order."""

from __future__ import annotations

import torch

from ctxcache.methods import make_method
from ctxcache.methods.quest import page_bounds, upper_bound

from .helpers import make_qkv


def test_bound_upper_bounds_every_key_of_its_page_also_after_fp16_storage():
    q, k, v, qd = make_qkv(n=203)  # last page short
    m = make_method("quest")
    t = m.build(q, k, v)
    bound = upper_bound(qd.view(2, 2, -1), t["page_min"].float(), t["page_max"].float())  # [Hkv, G, P]
    for keys in (k, k.half().float()):
        dots = torch.einsum("hgd,hnd->hgn", qd.view(2, 2, -1), keys)
        page_of = torch.arange(203) // 16
        assert (bound[..., page_of] >= dots - 1e-5).all()
    # and it is tight: some key of each page reaches the bound in each channel sum's sign pattern
    lo, hi = page_bounds(k, 16)
    assert torch.equal(lo[:, 0], k[:, :16].amin(1)) and torch.equal(hi[:, -1], k[:, 192:].amax(1))


def test_search_takes_pages_in_rank_order():
    q, k, v, qd = make_qkv(n=320)
    m = make_method("quest")
    state = m.open(m.build(q, k, v))
    idx = m.search(state, qd, k, 4, 288, 40)  # 2.5 pages
    score = m.page_scores(state, qd)  # [Hkv, P]
    for h in range(2):
        order = [p for p in score[h].argsort(descending=True).tolist()]
        want = []
        for p in order:
            want += [i for i in range(16 * p, 16 * p + 16) if 4 <= i < 288]
        assert sorted(idx[h].tolist()) == sorted(want[:40])


def test_append_extends_pages_like_a_rebuild():
    q, k, v, qd = make_qkv(n=100)
    m = make_method("quest")
    state = m.open(m.build(q[:, :70], k[:, :70], v[:, :70]))
    m.append(state, k[:, 70:90], 70)
    m.append(state, k[:, 90:], 90)
    lo, hi = page_bounds(k, 16)
    got_lo, got_hi = m._bounds(state)
    assert got_lo.shape == lo.shape  # 70 prefill keys -> 5 pages, 100 keys -> 7
    assert torch.equal(got_lo[:, :4], state.tables["page_min"][:, :4].float())
    assert (got_lo[:, 4] <= lo[:, 4]).all() and (got_hi[:, 4] >= hi[:, 4]).all()  # mixed page
    assert torch.equal(got_lo[:, 5:], lo[:, 5:]) and torch.equal(got_hi[:, 5:], hi[:, 5:])
