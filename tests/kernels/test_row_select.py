"""The one-launch selection of few rows (row_select) against the torch reference and against
the multi-launch pipeline (dense_dot8 + radix_topk) it replaces."""

import pytest
import torch
import torch.nn.functional as F

from ctxcache.kernels.dense_dot8 import dense_dot8
from ctxcache.kernels.route import route
from ctxcache.kernels.row_select import (HEAD, resident_programs, row_select, row_select_ref, row_workspace)
from ctxcache.kernels.topk import radix_topk, workspace
from ctxcache.methods.int8_tables import quantize_rows

N_PAD = 1024


def _case(device, b=2, hkv=2, g=2, m=4, c=8, db=4, n=704, t_max=8):
    q = torch.randn(b, hkv * g, m * db).to(torch.bfloat16)
    cent = F.normalize(torch.randn(b, hkv, m, c, db), dim=-1).half()
    dense, scale = quantize_rows(torch.randn(b, hkv, m, c, n).half())
    dense[:, :, :, :, 100:180] = dense[:, :, :, :, 20:100]  # repeated keys: ties across chunks
    new = torch.randn(b, hkv, m, c, t_max)
    n_ctx = torch.tensor([n, n - 96], dtype=torch.int32)[:b]
    count = torch.tensor([5, 0], dtype=torch.int32)[:b]  # row 0 has streamed keys after its table
    lo = torch.full((b,), 4, dtype=torch.int32)
    hi = (n_ctx + count - 2).int()
    k = torch.tensor([61, 0], dtype=torch.int32)[:b]  # row 1: an empty selection
    return [x.to(device) for x in (q, cent, dense, scale, new, n_ctx, n_ctx.clone(), count, lo, hi, k)]


def _buffers(case, programs, k_max=64):
    q, dense = case[0], case[2]
    b, hkv, m = q.shape[0], dense.shape[1], dense.shape[2]
    ids = torch.zeros(b, hkv, m, dtype=torch.int32, device=q.device)
    w = torch.zeros(b, hkv, m, device=q.device)
    out = torch.full((b, hkv, k_max), -1, dtype=torch.int32, device=q.device)
    return ids, w, row_workspace(b * hkv, programs, q.device), out


def _sets(out, k):
    b, hkv = out.shape[:2]
    return [sorted(out[r, h, :int(k[r])].tolist()) for r in range(b) for h in range(hkv)]


@pytest.mark.parametrize("programs", [1, 4, 16])
def test_row_select_matches_reference(device, programs):
    """Route, int8 scores and the exact Top-K (ties to the lowest index) in one kernel: the
    reference's sets, each index once."""
    case = _case(device)
    ids, w, ws, out = _buffers(case, programs)
    row_select(*case, ids, w, ws, out, N_PAD, programs)
    want = [r.tolist() for r in row_select_ref(*case, N_PAD)]
    assert _sets(out.cpu(), case[-1].cpu()) == want
    assert (out[1] == -1).all()  # k = 0: nothing written


def test_row_select_equals_the_multi_launch_pipeline(device):
    """Given the same route, the same selection as dense_dot8 -> radix_topk (its keys bit for
    bit), and the route it stores equals route.py's."""
    case = _case(device)
    q, cent, dense, scale, new, n_ctx, start, count, lo, hi, k = case
    ids, w = route(q.contiguous(), cent, group=True)
    keys = torch.empty(*dense.shape[:2], N_PAD, dtype=torch.uint16, device=device)
    tws = workspace(ids.shape[0] * ids.shape[1], device, blocks=N_PAD // 256)
    dense_dot8(ids, w, dense, scale, new, n_ctx, start, count, lo, hi, k, keys, tws, block=256)
    want = torch.zeros(*dense.shape[:2], 64, dtype=torch.int32, device=device)
    radix_topk(keys, lo, hi, k, want, tws, block=256, hist0_done=True)
    _, _, ws, out = _buffers(case, 4)
    row_select(*case, ids, w, ws, out, N_PAD, 4, routed=True)
    assert _sets(out.cpu(), k.cpu()) == _sets(want.cpu(), k.cpu())
    ids2, w2, ws2, out2 = _buffers(case, 4)
    row_select(*case, ids2, w2, ws2, out2, N_PAD, 4)
    assert torch.equal(ids2, ids)
    assert torch.allclose(w2, w, rtol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the one-launch form spins on a GPU barrier")
def test_row_select_one_launch_equals_phased_across_counter_wrap():
    """The barrier form gives the phased form's output, call after call, with the arrival
    counter started just below 2^31 so that it wraps in the middle."""
    case = _case("cuda", b=1, hkv=8, g=4, m=8, c=128, db=16, n=32768 - 64)
    want = _buffers(case, 16)
    row_select(*case, *want, 32768, 16, phased=True)
    ids, w, ws, out = _buffers(case, 16)
    ws[:, 0] = 2**31 - 40  # 16 programs x 2 barriers per call: wraps on the second call
    for _ in range(4):
        out.fill_(-1)
        row_select(*case, ids, w, ws, out, 32768, 16, phased=False)
        torch.cuda.synchronize()
        assert torch.equal(out, want[3])
    assert int(ws[0, 0]) == (2**31 - 40 + 4 * 32) - 2**32


def test_resident_programs_fit_the_gpu():
    assert resident_programs(8, 131072, 132) == 16  # batch 1 at 128K: 128 programs of 8192 keys
    assert resident_programs(8, 32768, 132) == 16
    assert resident_programs(64, 131072, 132) == 0  # batch 8: chunks of 65536 keys do not fit
    assert resident_programs(8, 139264, 132) == 0  # not a power-of-two chunk


def test_row_select_refuses_bad_shapes(device):
    case = _case(device)
    ids, w, ws, out = _buffers(case, 4)
    with pytest.raises(ValueError, match="power-of-two chunk"):
        row_select(*case, ids, w, ws, out, 1000, 4)
    with pytest.raises(ValueError, match="row_workspace"):
        row_select(*case, ids, w, ws[:, :HEAD], out, N_PAD, 4)
    with pytest.raises(ValueError, match="int8"):
        row_select(*case[:2], case[2].half(), *case[3:], ids, w, ws, out, N_PAD, 4)
