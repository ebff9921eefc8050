"""Chunk codec: bit-exact for every dtype, narrowing, compression choice, size checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zstandard

from ctxcache.store import codec


def _round(t: torch.Tensor, min_gain: float = 0.1) -> tuple[codec.Encoded, torch.Tensor]:
    e = codec.encode(t, min_gain=min_gain)
    out = torch.empty(t.shape, dtype=t.dtype)
    codec.decode_into(bytes(memoryview(e.payload).cast("B")), out, e.codec, e.stored_dtype)
    return e, out


@pytest.mark.parametrize("t", [
    torch.randn(3, 5, 7).half(), torch.randn(1823, 3).bfloat16(), torch.randn(11).float(),
    torch.randn(4).double(), torch.randint(-5, 5, (100,), dtype=torch.int8),
    torch.randint(0, 255, (100,), dtype=torch.uint8), torch.randint(-300, 300, (99,)).short(),
    torch.randint(0, 4096, (8, 1000)).int(), torch.randint(-40000, 40000, (1000,)).int(),
    torch.randint(0, 49152, (777,)), torch.randint(-2**40, 2**40, (50,)),
    torch.rand(200) > 0.5, torch.zeros(0, 4).half(), torch.tensor(3.5),
    torch.full((4096,), -7, dtype=torch.int32), torch.zeros(64, 64).bfloat16(),
])
def test_round_trip_bit_exact(t: torch.Tensor) -> None:
    e, out = _round(t)
    assert out.dtype == t.dtype and out.shape == t.shape
    assert torch.equal(out, t) or (t.is_floating_point() and
                                   torch.equal(out.view(torch.uint8), t.view(torch.uint8)))
    assert e.raw_bytes == t.numel() * t.element_size()


def test_index_arrays_are_narrowed_and_constant_ones_compressed() -> None:
    idx = torch.randint(0, 4096, (3, 8, 128, 64)).int()
    e = codec.encode(idx, min_gain=0.9)
    assert (e.codec, e.stored_dtype) == ("raw", "<u2") and len(e.payload) == idx.numel() * 2
    signed = codec.encode(torch.randint(-100, 100, (1000,)).int(), min_gain=0.9)
    assert signed.stored_dtype == "|i1"
    zeros = codec.encode(torch.zeros(10000).half())
    assert zeros.codec == "shuf+zstd" and len(zeros.payload) < 200
    noise = codec.encode(torch.randn(10000).half(), min_gain=0.1)
    assert noise.codec == "raw"  # random fp16 does not shrink by 10%


def test_declared_size_checked_before_decompression() -> None:
    out = torch.empty(1000, dtype=torch.float16)
    bomb = zstandard.ZstdCompressor().compress(bytes(1 << 24))  # declares 16 MiB
    with pytest.raises(ValueError, match="declares"):
        codec.decode_into(bomb, out, "zstd", "<f2")
    with pytest.raises(ValueError, match="payload holds"):
        codec.decode_into(bytes(1998), out, "raw", "<f2")
    with pytest.raises(ValueError, match="codec"):
        codec.decode_into(bytes(2000), out, "lz4", "<f2")


def test_checksums_differ_on_one_flipped_bit() -> None:
    data = bytearray(np.random.default_rng(0).bytes(1 << 16))
    a, b = codec.checksum(data), codec.fast_checksum(data)
    data[12345] ^= 1
    assert codec.checksum(data) != a and codec.fast_checksum(data) != b
