"""The block's glue kernels (RMSNorm, residual add + RMSNorm, SiLU x up) against the torch path."""

import pytest
import torch

from ctxcache.kernels.norm import add_rms_norm_ref, rms_norm, rms_norm_ref, silu_mul, silu_mul_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [64, 96])
def test_rms_norm_and_the_fused_add_match_torch(device, dtype, n):
    x = (3 * torch.randn(2, 5, n, device=device)).to(dtype)
    delta = torch.randn(2, 5, n, device=device).to(dtype)
    w = torch.rand(n, device=device).to(dtype) + 0.5
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2  # bf16: the sum of squares' order may move one rounding
    torch.testing.assert_close(rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5), rtol=tol, atol=tol)
    total, normed = rms_norm(x, w, 1e-5, delta=delta)
    want_total, want_normed = add_rms_norm_ref(x, delta, w, 1e-5)
    if device == "cuda" or dtype == torch.float32:  # the residual stream: one rounding of the same sum
        assert torch.equal(total, want_total)
    else:  # the interpreter casts fp32 to bf16 by truncation, not to nearest
        torch.testing.assert_close(total, want_total, rtol=8e-3, atol=0)
    torch.testing.assert_close(normed, want_normed, rtol=tol, atol=tol)


def test_rows_of_a_strided_view_and_no_rows(device):
    x = torch.randn(4, 2 * 64, device=device)[:, :64]  # rows 128 apart
    w = torch.rand(64, device=device)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), rtol=1e-5, atol=1e-5)
    assert rms_norm(x[:0], w, 1e-6).shape == (0, 64)


def test_silu_mul_matches_torch(device):
    gate_up = (4 * torch.randn(3, 2, 2 * 80, device=device)).to(torch.bfloat16)
    torch.testing.assert_close(silu_mul(gate_up), silu_mul_ref(gate_up), rtol=1.6e-2, atol=1.6e-2)
    f32 = torch.randn(3, 2 * 80, device=device)
    torch.testing.assert_close(silu_mul(f32), silu_mul_ref(f32), rtol=1e-5, atol=1e-5)


def test_bad_shapes_are_refused(device):
    x = torch.randn(2, 64, device=device)
    with pytest.raises(ValueError, match="disagree"):
        rms_norm(x, torch.ones(32, device=device), 1e-6)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        rms_norm(x.t(), torch.ones(2, device=device), 1e-6)
    with pytest.raises(ValueError, match="2 x the MLP width"):
        silu_mul(torch.randn(2, 5, device=device))
