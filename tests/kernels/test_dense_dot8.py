"""int8 tables scored by integer dot products (dense_dot8) against the torch reference."""

import pytest
import torch

from ctxcache.kernels.dense_dot8 import dense_dot8, dense_dot8_ref
from ctxcache.methods.int8_tables import quantize_rows, weight_scale
from ctxcache.kernels.dense_select import dense_scores_ref
from ctxcache.kernels.topk import _BINS, key16_codes, keys16_ref, workspace

from test_dense_select import _setup, check_pass0_and_topk


def _int8_case(device, group: bool, shared: bool = False, n: int = 704):
    ids, w, dense, new, n_ctx, start, count = _setup(device, shared=shared, n=n)
    if group:  # one routed row set per KV head (G * m = 4 rows: a single dp4a group)
        ids, w = ids[:, ::3].contiguous(), w[:, ::3].contiguous()
    dense, scale = quantize_rows(dense)
    return ids, w, dense, scale, new, n_ctx, start, count


def _run(device, case, block=128, asm=None, blocks=3):
    ids, w, dense, scale, new, n_ctx, start, count = case
    b, hkv = ids.shape[0], dense.shape[1]
    lo = torch.full((b,), 4, dtype=torch.int32, device=device)
    hi = (n_ctx + count - 2).int()
    k = torch.tensor([37, 20], dtype=torch.int32, device=device)
    keys = torch.full((b, hkv, 768), 7, dtype=torch.uint16, device=device)
    ws = workspace(b * hkv, device, blocks=blocks)
    dense_dot8(ids, w, dense, scale, new, n_ctx, start, count, lo, hi, k, keys, ws, block=block, asm=asm)
    return keys, ws, lo, hi, k


@pytest.mark.parametrize("group,shared", [(True, False), (False, False), (False, True)])
def test_dense_dot8_keys_match_reference(device, group, shared):
    """Context keys bitwise (integer sums times a power of two); streamed keys (fp32 sums in
    another order) within one key step; pass 0 counts the kernel's own keys in [lo, hi); the
    radix Top-K over them equals the reference Top-K."""
    case = _int8_case(device, group, shared)
    ids, w, dense, scale, new, n_ctx, start, count = case
    keys, ws, lo, hi, k = _run(device, case)
    b = ids.shape[0]
    want = keys16_ref(dense_dot8_ref(*case, 768)).cpu()
    got = key16_codes(keys.cpu())
    for r in range(b):
        nc, cnt = int(n_ctx[r]), int(count[r])
        assert torch.equal(got[r, :, :nc], want[r, :, :nc])
        assert ((got[r, :, nc:nc + cnt] - want[r, :, nc:nc + cnt]).abs() <= 1).all()
        assert torch.equal(got[r, :, nc + cnt:], want[r, :, nc + cnt:])  # padding: score 0
    check_pass0_and_topk(keys, ws, lo, hi, k)


def test_dense_dot8_blocks_tile_the_row(device):
    """The same keys whatever the block (64 keys: 16 words; 256: 64 words)."""
    case = _int8_case(device, group=True)
    a = _run(device, case, block=64, blocks=3)[0]
    b = _run(device, case, block=256, blocks=3)[0]
    assert torch.equal(a.cpu(), b.cpu())


def test_dense_dot8_is_close_to_fp32_weights(device):
    """Quantizing the weights costs at most half a step of 2^e per row product: the scores stay
    within that bound of the fp32-weight int8 reference (dense_select)."""
    ids, w, dense, scale, new, n_ctx, start, count = _int8_case(device, group=False)
    got = dense_dot8_ref(ids, w, dense, scale, new, n_ctx, start, count, 768)
    want = dense_scores_ref(ids, w, dense, scale, new, n_ctx, start, count, 768)
    b, hkv = ids.shape[0], dense.shape[1]
    ws = w.view(b, hkv, -1).float() * scale[torch.arange(b)[:, None, None], torch.arange(hkv)[None, :, None],
                                            (torch.arange(ids.shape[1] // hkv * ids.shape[2]) % ids.shape[2])[None, None],
                                            ids.view(b, hkv, -1).long()]
    _, deq = weight_scale(ws)
    bound = 0.5 * deq * 127 * ws.shape[-1]  # half a weight step x the largest |int8| x rows
    assert ((got - want).abs() <= bound[..., None] + 1e-6).all()
    assert (got - want).abs().max() > 0  # the weights really were quantized


def test_dense_dot8_zero_weights_give_zero_scores(device):
    ids, w, dense, scale, new, n_ctx, start, count = _int8_case(device, group=True)
    w.zero_()
    keys = _run(device, (ids, w, dense, scale, new, n_ctx, start, count))[0]
    assert (key16_codes(keys.cpu())[0, :, :int(n_ctx[0])] == int(keys16_ref(torch.zeros(1))[0])).all()


@pytest.mark.gpu(reason="the inline PTX path needs a GPU")
def test_dense_dot8_ptx_equals_shift_path():
    for group in (True, False):
        case = _int8_case("cuda", group)
        assert torch.equal(_run("cuda", case, asm=True)[0], _run("cuda", case, asm=False)[0])


def test_dense_dot8_refuses_bad_tables(device):
    ids, w, dense, scale, new, n_ctx, start, count = _int8_case(device, group=True)
    args = (new, n_ctx, start, count, n_ctx, n_ctx, n_ctx, torch.empty(2, 2, 768, dtype=torch.uint16, device=device),
            workspace(4, device))
    with pytest.raises(ValueError, match="int8"):
        dense_dot8(ids, w, dense.half(), scale, *args)
    with pytest.raises(ValueError, match="16-key"):
        dense_dot8(ids, w, dense[..., :700], scale, *args)
    with pytest.raises(ValueError, match="power of two"):
        dense_dot8(ids, w, dense, scale, *args, block=96)


@pytest.mark.gpu(reason="the shared-memory histogram is inline PTX")
@pytest.mark.parametrize("block,warps", [(64, 4), (1024, 4), (2048, 8)])
def test_dense_dot8_shared_memory_pass0_equals_tl_histogram(block, warps):
    case = _int8_case("cuda", group=True, n=4000 // 16 * 16)
    ids, w, dense, scale, new, n_ctx, start, count = case
    b, hkv = ids.shape[0], dense.shape[1]
    lo = torch.full((b,), 4, dtype=torch.int32, device="cuda")
    hi = (n_ctx + count - 2).int()
    k = torch.tensor([370, 200], dtype=torch.int32, device="cuda")
    out = []
    for smem in (True, False):
        keys = torch.empty(b, hkv, 4096, dtype=torch.uint16, device="cuda")
        ws = workspace(b * hkv, "cuda", blocks=4)
        dense_dot8(ids, w, dense, scale, new, n_ctx, start, count, lo, hi, k, keys, ws, block=block,
                   num_warps=warps, smem_hist=smem)
        out.append((keys, ws[:, :_BINS].clone()))
    assert torch.equal(out[0][0], out[1][0])
    assert torch.equal(out[0][1], out[1][1]) and int(out[0][1].sum()) > 0
