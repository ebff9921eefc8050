"""Dense-layout selection scores (+ fused radix pass 0) against the torch reference."""

import pytest
import torch
import torch.nn.functional as F

from ctxcache.kernels.dense_select import dense_scores, dense_scores_ref
from ctxcache.methods.int8_tables import quantize_rows
from ctxcache.kernels.route import route
from ctxcache.kernels.topk import _BINS, key16_codes, keys16_ref, radix_topk, topk16_ref, topk_ref, workspace


def _setup(device, b=2, hkv=2, g=3, m=4, c=13, n=700, t_max=6, shared=False):
    """Awkward sizes: group of 3 (G * m = 12, padded to 16), C and N not powers of two."""
    rows = 1 if shared else b
    dense = torch.randn(rows, hkv, m, c, n).half()
    if shared:  # one table for every row (stride 0), as the e2e bench shares buffers
        dense = dense.expand(b, -1, -1, -1, -1)
    ids = torch.randint(0, c, (b, hkv * g, m), dtype=torch.int32)
    ids[:, 1] = ids[:, 0]  # two heads of a group on the same rows: a repeated row adds twice
    w = torch.rand(b, hkv * g, m)
    new = torch.randn(b, hkv, m, c, t_max)
    n_ctx = torch.tensor([n, n - 100], dtype=torch.int32)[:b]
    count = torch.tensor([4, 0], dtype=torch.int32)[:b]  # row 1 has no streamed keys yet
    return [x.to(device) for x in (ids, w, dense, new, n_ctx, n_ctx.clone(), count)]


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("n", [700, 704])  # 704: rows of whole 16-key runs, the vector-load mask (ALIGN16)
def test_dense_scores_match_reference(device, int8, shared, n):
    ids, w, dense, new, n_ctx, start, count = _setup(device, shared=shared, n=n)
    scale = None
    if int8:
        dense, scale = quantize_rows(dense)
    b, hkv = ids.shape[0], dense.shape[1]
    block = 128
    n_max = 768  # covers n + streamed keys, a multiple of block
    lo = torch.full((b,), 4, dtype=torch.int32, device=device)
    hi = (n_ctx + count - 2).int()
    k = torch.tensor([37, 20], dtype=torch.int32, device=device)
    acc = torch.full((b, hkv, n_max), float("nan"), device=device)  # poisoned: every entry must be written
    ws = workspace(b * hkv, device)
    dense_scores(ids, w, dense, scale, new, n_ctx, start, count, lo, hi, k, acc, ws, block=block, r_chunk=4)
    want = dense_scores_ref(ids, w, dense, scale, new, n_ctx, start, count, n_max)
    torch.testing.assert_close(acc, want, rtol=1e-4, atol=1e-4)
    # the fused pass-0 histogram equals one computed from the reference scores
    from ctxcache.kernels.topk import _PASSES
    want_ws = workspace(b * hkv, device)
    radix_ws = want_ws.clone()
    out = torch.zeros(b, hkv, 37, dtype=torch.int32, device=device)
    radix_topk(want, lo, hi, k, out, radix_ws)  # full 4 passes from scratch
    assert torch.equal(ws[:, :_BINS].cpu(), radix_ws[:, :_BINS].cpu())
    assert _PASSES == 4


def test_dense_select_exact_topk(device):
    """Scores + radix passes 1-3 + collect give the same values as torch.topk of the reference."""
    ids, w, dense, new, n_ctx, start, count = _setup(device)
    b, hkv = ids.shape[0], dense.shape[1]
    n_max = 768
    lo = torch.full((b,), 4, dtype=torch.int32, device=device)
    hi = (n_ctx + count - 2).int()
    k = torch.tensor([37, 20], dtype=torch.int32, device=device)
    acc = torch.empty(b, hkv, n_max, device=device)
    ws = workspace(b * hkv, device)
    out = torch.full((b, hkv, 37), -1, dtype=torch.int32, device=device)
    dense_scores(ids, w, dense, None, new, n_ctx, start, count, lo, hi, k, acc, ws, block=256)
    radix_topk(acc, lo, hi, k, out, ws, block=256, hist0_done=True)
    want = dense_scores_ref(ids, w, dense, None, new, n_ctx, start, count, n_max)
    refs = topk_ref(want.view(b * hkv, -1), lo.repeat_interleave(hkv), hi.repeat_interleave(hkv),
                    k.repeat_interleave(hkv))
    for r in range(b * hkv):
        kk = int(k[r // hkv])
        got = out.view(b * hkv, -1)[r, :kk].long()
        assert got.unique().numel() == kk
        vals = want.view(b * hkv, -1)[r]
        # same values as torch.topk up to fp32 summation order (indices of near-ties may differ)
        torch.testing.assert_close(vals[got].sort().values, vals[refs[r]].sort().values, rtol=1e-5, atol=1e-5)
        assert len(set(got.tolist()) & set(refs[r].tolist())) >= kk - 1


@pytest.mark.parametrize("group", [False, True])
def test_dense_scores_16bit_keys(device, group):
    """uint16 output: the keys of the fp16-rounded scores, and pass 0 counted over those keys;
    group=True feeds one routed row set per KV head (routing='group': ids [B, Hkv, m])."""
    ids, w, dense, new, n_ctx, start, count = _setup(device)
    if group:
        ids, w = ids[:, ::3].contiguous(), w[:, ::3].contiguous()
    b, hkv = ids.shape[0], dense.shape[1]
    n_max = 768
    lo = torch.full((b,), 4, dtype=torch.int32, device=device)
    hi = (n_ctx + count - 2).int()
    k = torch.tensor([37, 20], dtype=torch.int32, device=device)
    keys = torch.empty(b, hkv, n_max, dtype=torch.uint16, device=device)
    ws = workspace(b * hkv, device, blocks=3)  # radix blocks of 256 over 768 keys
    dense_scores(ids, w, dense, None, new, n_ctx, start, count, lo, hi, k, keys, ws, block=128, r_chunk=4)
    want = keys16_ref(dense_scores_ref(ids, w, dense, None, new, n_ctx, start, count, n_max)).cpu()
    got = key16_codes(keys.cpu())
    # equal up to fp32 summation order at an fp16 rounding boundary (one key step)
    assert (got - want).abs().max() <= 1 and (got == want).float().mean() > 0.99
    check_pass0_and_topk(keys, ws, lo, hi, k)


def check_pass0_and_topk(keys, ws, lo, hi, k) -> None:
    """The score kernel's pass 0 in ws counts its own 16-bit keys in [lo, hi), and the radix
    Top-K after it (blocks of 256) selects the reference Top-K of those keys."""
    b, hkv = keys.shape[:2]
    got = key16_codes(keys.cpu())
    for r in range(b):
        for h in range(hkv):
            row = got[r, h, int(lo[r]):int(hi[r])]
            assert torch.equal(ws.view(b, hkv, -1)[r, h, :_BINS].cpu(), torch.bincount(row >> 8, minlength=_BINS).int())
    out = torch.full((b, hkv, int(k.max())), -1, dtype=torch.int32, device=keys.device)
    radix_topk(keys, lo, hi, k, out, ws, block=256, hist0_done=True)
    refs = topk16_ref(got.view(b * hkv, -1), lo.repeat_interleave(hkv).cpu(), hi.repeat_interleave(hkv).cpu(),
                      k.repeat_interleave(hkv).cpu())
    for r in range(b * hkv):
        kk = int(k[r // hkv])
        assert torch.equal(out.view(b * hkv, -1)[r, :kk].long().cpu().sort().values, refs[r])


@pytest.mark.parametrize("routing", ["head", "group"])
def test_route_then_dense_scores_follow_csattention_estimate(device, routing):
    """The routed weights feed the same math as CSAttention.estimate (qnorm, group sum)."""
    from ctxcache.methods.base import LayerState
    from ctxcache.methods.csattention import CSAttention, CSAttentionParams

    hq, hkv, d, m, c, n = 4, 2, 32, 4, 8, 300
    method = CSAttention(CSAttentionParams(subspaces=m, centroids=c, routing=routing, rerank=1.0))
    cent = F.normalize(torch.randn(hkv, m, c, d // m), dim=-1).half()
    dense = torch.randn(hkv, m, c, n).half()
    q = torch.randn(hq, d)
    want = method._combine(method.estimate(LayerState({"centroids": cent, "dense_score": dense}), q, n), d)
    ids, wts = route(q[None].to(device), cent[None].to(device), group=routing == "group")
    one = torch.ones(1, dtype=torch.int32, device=device)
    acc = torch.empty(1, hkv, 384, device=device)
    dense_scores(ids, wts, dense[None].to(device), None, torch.zeros(1, hkv, m, c, 1, device=device),
                 one * n, one * n, one * 0, one * 0, one * n, one * 10, acc, workspace(hkv, device), block=128)
    torch.testing.assert_close(acc[0, :, :n].cpu(), want, rtol=1e-4, atol=1e-4)


def test_quantize_rows_error_is_small():
    x = torch.randn(3, 5, 1000).half()
    q, s = quantize_rows(x)
    err = (q.float() * s[..., None] - x.float()).abs().max()
    assert err <= s.max() / 2 + 1e-6


@pytest.mark.gpu(reason="the shared-memory histogram is inline PTX")
@pytest.mark.parametrize("block,warps,r_chunk", [(128, 4, 4), (1024, 4, 8), (1024, 8, 8), (2048, 4, 8)])
def test_shared_memory_pass0_equals_tl_histogram(block, warps, r_chunk):
    """Pass 0 by shared-memory atomics counts what tl.histogram counts, whatever the launch
    shape (small blocks hold keys in several threads: the replication is divided out)."""
    ids, w, dense, new, n_ctx, start, count = _setup("cuda", n=4000)
    b, hkv = ids.shape[0], dense.shape[1]
    n_max = 4096
    lo = torch.full((b,), 4, dtype=torch.int32, device="cuda")
    hi = (n_ctx + count - 2).int()
    k = torch.tensor([370, 200], dtype=torch.int32, device="cuda")
    out = []
    for smem in (True, False):
        keys = torch.empty(b, hkv, n_max, dtype=torch.uint16, device="cuda")
        ws = workspace(b * hkv, "cuda", blocks=4)
        dense_scores(ids, w, dense, None, new, n_ctx, start, count, lo, hi, k, keys, ws, block=block,
                     r_chunk=r_chunk, num_warps=warps, smem_hist=smem)
        out.append((keys, ws[:, :_BINS].clone()))
    assert torch.equal(out[0][0], out[1][0])
    assert torch.equal(out[0][1], out[1][1]) and int(out[0][1].sum()) > 0
