"""The packed prefill's last launch (the last keys' causal attention, then every span's partial
folded in by its log-sum-exp) equals its torch reference; on the CPU through TRITON_INTERPRET."""

import pytest
import torch

from ctxcache.kernels.span_merge import ROWS, merge, merge_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("hkv,r,t,left,p,dtype", [
    (2, 4 * 5, 5, 3, 7, torch.float32), (1, ROWS + 3, 1, 0, 1, torch.float32), (4, 2 * ROWS, 32, 31, 33, torch.float32),
    (2, 4 * 16, 16, 40, 3, torch.bfloat16)])
def test_merge_equals_the_reference(hkv, r, t, left, p, dtype):
    g = torch.Generator().manual_seed(r + left + p)
    rows = (torch.randn(hkv, r, 32, generator=g) * 2).to(DEVICE, dtype)
    kv = torch.randn(2, hkv, left + t + 5, 32, generator=g).to(DEVICE, dtype)[:, :, :left + t]  # a cache's strided keys
    outs = torch.randn(p, hkv, r, 32, generator=g).to(DEVICE, dtype)
    lses = (torch.randn(p, hkv, r, generator=g) * 4).to(DEVICE)
    got = merge(rows, kv[0], kv[1], t, outs, lses)
    want = merge_ref(rows, kv[0], kv[1], t, outs, lses)
    assert got.dtype == dtype and got.shape == rows.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_a_row_sees_only_the_keys_up_to_its_token():
    """With no spans, row (g, i) is attention over the leftover keys and the prompt's first i + 1."""
    rows, k, v = torch.randn(1, 6, 16, device=DEVICE), torch.randn(1, 5, 16, device=DEVICE), torch.randn(1, 5, 16, device=DEVICE)
    none = torch.zeros(0, 1, 6, 16, device=DEVICE), torch.zeros(0, 1, 6, device=DEVICE)
    got = merge(rows, k, v, 3, *none)
    for row in range(6):
        seen = 2 + row % 3 + 1
        want = torch.softmax(rows[0, row] @ k[0, :seen].T / 4, -1) @ v[0, :seen]
        torch.testing.assert_close(got[0, row], want, rtol=1e-5, atol=1e-5)


def test_merge_refuses_an_odd_head_dim():
    with pytest.raises(ValueError, match="power-of-two head dim"):
        merge(torch.zeros(1, 4, 24), torch.zeros(1, 4, 24), torch.zeros(1, 4, 24), 4, torch.zeros(0, 1, 4, 24),
              torch.zeros(0, 1, 4))
