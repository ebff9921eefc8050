"""Follow's seed scores by the three-launch kernel equal the torch reference: the group-summed
softmax of the last query over the real keys, 0 for the padding and up to 16 keys; their 16-bit
keys with radix pass 0 fused, and the seed's Top-K over them; on the CPU through TRITON_INTERPRET."""

import pytest
import torch

from ctxcache.kernels import seed_probs as seed_module
from ctxcache.kernels.seed_probs import BLOCK, KEY_BLOCK, seed_probs, seed_probs_ref, seed_topk, workspace_columns
from ctxcache.kernels.topk import key16_codes, topk16_ref
from ctxcache.methods.budget import fp16_keys

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("hq,hkv,n,n_real,dtype", [
    (8, 2, 300, 290, torch.float32), (4, 4, 2 * BLOCK, 2 * BLOCK, torch.float32), (12, 4, 37, 1, torch.float32),
    (8, 2, 3 * BLOCK + 5, 3 * BLOCK - 7, torch.bfloat16)])
def test_seed_probs_equal_the_reference(hq, hkv, n, n_real, dtype):
    g = torch.Generator().manual_seed(n + hq)
    q = (torch.randn(hq, 64, generator=g) * 3).to(DEVICE, dtype)
    keys = torch.randn(hkv, n + 9, 64, generator=g).to(DEVICE, dtype)[:, :n]  # a slot's first n keys
    out = torch.full((hkv, n + -n % 16), 7.0, device=DEVICE)
    got = seed_probs(q, keys, torch.tensor([n_real], dtype=torch.int32, device=DEVICE), out)
    want = seed_probs_ref(q.float(), keys.float(), torch.arange(n, device=DEVICE) >= n_real)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * 1e-2)
    assert torch.all(got[:, n_real:] == 0)
    torch.testing.assert_close(got.sum(-1), torch.full((hkv,), float(hq // hkv), device=DEVICE), rtol=1e-4, atol=1e-4)


def test_seed_probs_refuse_a_wrong_output():
    q, keys = torch.randn(4, 16), torch.randn(2, 40, 16)
    with pytest.raises(ValueError, match="must be contiguous fp32"):
        seed_probs(q, keys, torch.tensor([40], dtype=torch.int32), torch.zeros(2, 40))


def _seed_case(hq, hkv, n, n_real, dtype):
    g = torch.Generator().manual_seed(n + hq)
    q = (torch.randn(hq, 64, generator=g) * 3).to(DEVICE, dtype)
    keys = torch.randn(hkv, n, 64, generator=g).to(DEVICE, dtype)
    return q, keys, torch.tensor([n_real], dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("hq,hkv,n,n_real,lo,hi,k", [
    (8, 2, 300, 290, 4, 270, 16), (4, 4, KEY_BLOCK + 37, KEY_BLOCK + 30, 4, KEY_BLOCK, 40), (8, 2, 37, 37, 0, 37, 37)])
def test_16_bit_seed_keys_carry_radix_pass_0_and_select_their_reference_top_k(hq, hkv, n, n_real, lo, hi, k):
    """The probs launch writing 16-bit keys writes fp16_keys of its fp32 probabilities and pass 0's
    histogram of [lo, hi) into a workspace it finds dirty (the norm launch zeroes it); seed_topk
    then picks topk16_ref's keys of them."""
    q, keys, real = _seed_case(hq, hkv, n, n_real, torch.float32)
    bounds = torch.tensor([lo, hi, k], dtype=torch.int32, device=DEVICE)
    ws = torch.full((hkv, workspace_columns(n) + 5), 7, dtype=torch.int32, device=DEVICE)
    n_pad = n + -n % 16
    codes = torch.empty(hkv, -(-n_pad // KEY_BLOCK) * KEY_BLOCK, dtype=torch.uint16, device=DEVICE)
    seed_probs(q, keys, real, codes, hist=(bounds, ws))
    probs = seed_probs(q, keys, real, torch.empty(hkv, n_pad, device=DEVICE))
    want = fp16_keys(probs)
    assert torch.equal(key16_codes(codes[:, :n_pad]), want)
    for h in range(hkv):
        assert torch.equal(ws[h, :256], torch.bincount(want[h, lo:hi] >> 8, minlength=256).int())
    assert torch.all(ws[:, 256:workspace_columns(n)] == 0) and torch.all(ws[:, workspace_columns(n):] == 7)
    out = torch.full((1, hkv, k + 3), -1, dtype=torch.int32, device=DEVICE)
    seed_topk(q, keys, bounds, ws, out, real)
    lims = [torch.tensor([x]) for x in (lo, hi, k)]
    for h in range(hkv):
        assert sorted(out[0, h, :k].tolist()) == topk16_ref(want[h:h + 1], *lims)[0].tolist()
    assert torch.all(out[0, :, k:] == -1)


def test_seed_rows_of_any_length_share_one_collect_build(monkeypatch):
    """The collect's block bound comes from the workspace, not the row: rows of 300 and of 9000
    keys (1 and 3 radix blocks) over one workspace sized for 20000 take the same bound (one
    compiled collect while serving any context), and the bound above the row's blocks still
    picks topk16_ref's keys."""
    from ctxcache.kernels import topk
    bounds_seen = []
    radix = seed_module.radix_topk
    monkeypatch.setattr(seed_module, "radix_topk",
                        lambda *a, **kw: (bounds_seen.append(kw["nb_pad"]), radix(*a, **kw))[1])
    ws = torch.zeros(2, workspace_columns(20000), dtype=torch.int32, device=DEVICE)
    for n in (300, 9000):
        q, keys, real = _seed_case(4, 2, n, n, torch.float32)
        bounds = torch.tensor([4, n - 8, 40], dtype=torch.int32, device=DEVICE)
        out = torch.full((1, 2, 40), -1, dtype=torch.int32, device=DEVICE)
        seed_topk(q, keys, bounds, ws, out, real)
        n_pad = n + -n % 16
        want = fp16_keys(seed_probs(q, keys, real, torch.empty(2, n_pad, device=DEVICE)))
        for h in range(2):
            lims = [torch.tensor([x]) for x in (4, n - 8, 40)]
            assert sorted(out[0, h].tolist()) == topk16_ref(want[h:h + 1], *lims)[0].tolist()
    assert bounds_seen == [8, 8] and topk.blocks16(20016, seed_module.RADIX_BLOCK) == 5


def test_the_torch_seed_chain_selects_by_the_same_16_bit_keys(monkeypatch):
    """FUSED_SEED off: seed_probs_ref's probabilities, ranked by fp16_keys (the padding masked)."""
    q, keys, real = _seed_case(8, 2, 300, 290, torch.float32)
    bounds = torch.tensor([4, 280, 24], dtype=torch.int32, device=DEVICE)
    padding = torch.arange(10, device=DEVICE) >= 0  # the last 10 keys pad the prompt
    monkeypatch.setattr(seed_module, "FUSED_SEED", False)
    out = torch.full((1, 2, 24), -1, dtype=torch.int32, device=DEVICE)
    seed_topk(q, keys, bounds, torch.zeros(2, workspace_columns(300), dtype=torch.int32, device=DEVICE), out,
              real, padding)
    want = fp16_keys(seed_probs_ref(q, keys, padding))
    for h in range(2):
        lims = [torch.tensor([x]) for x in (4, 280, 24)]
        assert sorted(out[0, h].tolist()) == topk16_ref(want[h:h + 1], *lims)[0].tolist()


def test_16_bit_seed_keys_refuse_a_short_workspace():
    q, keys, real = _seed_case(4, 2, 40, 40, torch.float32)
    with pytest.raises(ValueError, match="workspace"):
        seed_probs(q, keys, real, torch.empty(2, KEY_BLOCK, dtype=torch.uint16),
                   hist=(torch.tensor([0, 40, 4], dtype=torch.int32), torch.zeros(2, 100, dtype=torch.int32)))
