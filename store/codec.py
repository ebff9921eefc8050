"""Encode one tensor into stored bytes and back, choosing per chunk what pays.

Measured on SmolLM2 artifacts (store/README.md): fp16 K/V and scores barely compress, so
floats are stored raw unless a sample shrinks by `min_gain`; integer index arrays are first
narrowed to the smallest integer type that holds their range (int32 list indices < 65536
become uint16: 2x for free, one cast to undo) and then zstd-compressed (byte-shuffled) only
when that pays too. Order and dtype are preserved, so a round trip is bit-exact.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch
import zstandard

# torch dtype name -> (numpy dtype holding its bits, True if the bits are a view, not a value)
_NP = {
    "float16": ("<f2", False), "float32": ("<f4", False), "float64": ("<f8", False),
    "bfloat16": ("<i2", True), "int8": ("|i1", False), "uint8": ("|u1", False),
    "int16": ("<i2", False), "int32": ("<i4", False), "int64": ("<i8", False),
    "bool": ("|b1", False),
}
_INTS = ("|u1", "|i1", "<u2", "<i2", "<u4", "<i4")


@dataclass(frozen=True)
class Encoded:
    codec: str  # "raw" | "zstd" | "shuf+zstd"
    stored_dtype: str
    payload: bytes | memoryview
    raw_bytes: int
    sha256: str


def dtype_name(t: torch.Tensor) -> str:
    name = str(t.dtype).removeprefix("torch.")
    if name not in _NP:
        raise ValueError(f"tensor dtype {t.dtype} cannot be stored; supported: {sorted(_NP)}")
    return name


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    name = dtype_name(t)
    t = t.detach().cpu().contiguous()
    np_dtype, is_view = _NP[name]
    arr = t.view(torch.int16).numpy() if is_view else t.numpy()
    return arr.reshape(-1).astype(np_dtype, copy=False)


def _narrow(arr: np.ndarray) -> np.ndarray:
    """Smallest integer type holding arr's range (integers only; bits views stay as they are)."""
    if arr.dtype.kind not in "iu" or arr.size == 0 or arr.itemsize == 1:
        return arr
    lo, hi = int(arr.min()), int(arr.max())
    for cand in _INTS:
        info = np.iinfo(np.dtype(cand))
        if np.dtype(cand).itemsize < arr.itemsize and info.min <= lo and hi <= info.max:
            return arr.astype(cand)
    return arr


def _shuffle(data: np.ndarray) -> np.ndarray:
    """Group byte 0 of every element, then byte 1, ...: exponent bytes then compress together."""
    return data.view(np.uint8).reshape(-1, data.itemsize).T.copy()


def _unshuffle(data: bytes, itemsize: int) -> np.ndarray:
    return np.frombuffer(data, np.uint8).reshape(itemsize, -1).T.copy().reshape(-1)


def _compress(arr: np.ndarray, level: int) -> tuple[str, bytes]:
    codec = "shuf+zstd" if arr.itemsize > 1 else "zstd"
    body = _shuffle(arr) if arr.itemsize > 1 else arr
    return codec, zstandard.ZstdCompressor(level=level, write_content_size=True).compress(body)


def encode(t: torch.Tensor, level: int = 3, min_gain: float = 0.1,
           sample_bytes: int = 1 << 20) -> Encoded:
    """Encode t; compress only if a sample (then the whole) shrinks by at least min_gain."""
    raw = _as_numpy(t)
    arr = _narrow(raw)
    payload: bytes | memoryview = memoryview(arr).cast("B")
    codec = "raw"
    n_sample = max(1, sample_bytes // arr.itemsize)
    if arr.nbytes >= 64 and _gain(arr[:n_sample], level) >= min_gain:
        codec, packed = _compress(arr, level)
        if 1 - len(packed) / arr.nbytes >= min_gain:
            payload = packed
        else:
            codec = "raw"
    return Encoded(codec, arr.dtype.str, payload, raw.nbytes, hashlib.sha256(payload).hexdigest())


def _gain(sample: np.ndarray, level: int) -> float:
    return 1 - len(_compress(sample, level)[1]) / max(1, sample.nbytes)


def checksum(buf: bytes | memoryview) -> str:
    return hashlib.sha256(buf).hexdigest()


def decode(buf: bytes | memoryview, dtype: str, shape: tuple[int, ...], codec: str,
           stored_dtype: str) -> torch.Tensor:
    """Stored bytes -> a fresh tensor (copied out of buf, so buf may die afterwards).

    Raises ValueError when the payload's declared or actual size disagrees with the manifest;
    the decompressed size is checked from the frame header BEFORE decompressing."""
    if dtype not in _NP:
        raise ValueError(f"unknown dtype {dtype!r}")
    sdt = np.dtype(stored_dtype)
    numel = int(np.prod(shape, dtype=np.int64))
    want = numel * sdt.itemsize
    if codec == "raw":
        data = buf
    elif codec in ("zstd", "shuf+zstd"):
        declared = zstandard.frame_content_size(buf)
        if declared != want:
            raise ValueError(f"zstd frame declares {declared} bytes, manifest {want}")
        data = zstandard.ZstdDecompressor().decompress(buf, max_output_size=want)
        if codec == "shuf+zstd":
            data = _unshuffle(data, sdt.itemsize)
    else:
        raise ValueError(f"unknown codec {codec!r}")
    if len(memoryview(data).cast("B")) != want:
        raise ValueError(f"payload holds {len(memoryview(data).cast('B'))} bytes, manifest {want}")
    return _fill(np.frombuffer(data, sdt), dtype, shape)


def _fill(src: np.ndarray, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    np_dtype, is_view = _NP[dtype]
    out = torch.empty(shape, dtype=getattr(torch, dtype))
    dst = out.view(torch.int16).numpy() if is_view else out.numpy()
    np.copyto(dst.reshape(-1), src, casting="safe")
    return out


def itemsize(stored_dtype: str) -> int:
    return np.dtype(stored_dtype).itemsize
