"""The one-launch int8 row quantization (the GPU build) against torch's quantize_rows."""

import pytest
import torch

from ctxcache.kernels.quantize import quantize_rows_fused
from ctxcache.methods.int8_tables import int8_dense_tables, quantize_rows


def test_quantize_rows_fused_equals_torch_bitwise(device):
    x = torch.randn(3, 5, 1000).half()
    x[0, 0, :6] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -2.5])  # scale 1: exact .5 ties, to even
    x[0, 0, 6:] = 0.0
    x[1, 2] = 0.0  # an all-zero row: the scale's floor
    x[2, 1, ::7] *= 300.0  # rows whose absmax dwarfs the rest
    want_q, want_s = quantize_rows(x)
    got_q, got_s = quantize_rows_fused(x.to(device), block=256)  # several blocks per row, a ragged tail
    assert torch.equal(got_s.cpu(), want_s)
    assert torch.equal(got_q.cpu(), want_q)
    assert got_q[0, 0, :6].tolist() == [127, 0, 2, 2, 0, -2]


def test_int8_dense_tables_by_the_kernel_keeps_int8_tables(device):
    t = {"dense_score": torch.randn(2, 4, 64).half().to(device)}
    q = int8_dense_tables(t, quantize_rows_fused)
    assert q["dense_score"].dtype == torch.int8 and q["dense_scale"].shape == (2, 4)
    assert int8_dense_tables(q, quantize_rows_fused) is q


def test_quantize_rows_fused_refuses_fp32(device):
    if device == "cpu" and not __import__("os").environ.get("TRITON_INTERPRET"):
        pytest.skip("torch fallback path")
    with pytest.raises(ValueError, match="float16"):
        quantize_rows_fused(torch.randn(2, 16, device=device))
