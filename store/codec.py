"""Encode one tensor into stored bytes and back, choosing per chunk what pays.

Measured on a SmolLM2 4K-token artifact (store/README.md): integer index arrays are first
narrowed to the smallest integer type holding their range (int32 list indices < 65536 become
uint16: 2x for free, one widening pass to undo). Then a chunk is zstd-compressed (byte
shuffled first) only if a sample, then the whole, shrinks by `min_gain`: fp16 K/V shrink by
only 1.2x and decompress at 0.5-0.9 GB/s vs ~4 GB/s for a raw copy, so with the default
min_gain they stay raw. Order and dtype are preserved, so a round trip is bit-exact.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch
import xxhash
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
    xxh3: str


def dtype_name(t: torch.Tensor) -> str:
    name = str(t.dtype).removeprefix("torch.")
    if name not in _NP:
        raise ValueError(f"tensor dtype {t.dtype} cannot be stored; supported: {sorted(_NP)}")
    return name


def stored_name(t: torch.Tensor) -> str:
    """The stored dtype that a raw chunk of t's own bits declares (not narrowed)."""
    return np.dtype(_NP[dtype_name(t)][0]).str


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
    return Encoded(codec, arr.dtype.str, payload, raw.nbytes, checksum(payload),
                   fast_checksum(payload))


def _gain(sample: np.ndarray, level: int) -> float:
    return 1 - len(_compress(sample, level)[1]) / max(1, sample.nbytes)


def checksum(buf: bytes | memoryview) -> str:
    """sha256: what Verify checks (and what the manifest promises)."""
    return hashlib.sha256(buf).hexdigest()


def fast_checksum(buf: bytes | memoryview) -> str:
    """xxh3-64: checked on every load. ~10 GB/s here vs 0.8-1.6 GB/s for sha256, which would
    otherwise dominate loading a 4K-token artifact; it catches accidental corruption (flipped
    bits, torn or misplaced pages) with a 2^-64 miss rate, sha256 remains for Verify."""
    return xxhash.xxh3_64_hexdigest(buf)


def decode_into(buf: bytes | memoryview, out: torch.Tensor, codec: str,
                stored_dtype: str) -> torch.Tensor:
    """Stored bytes -> out (a fresh contiguous tensor of the manifest's dtype and shape).

    Everything is copied out of buf, so buf may die afterwards. Raises ValueError when the
    payload's declared or actual size disagrees with the manifest; the decompressed size is
    checked from the zstd frame header BEFORE decompressing (no decompression bombs)."""
    sdt = np.dtype(stored_dtype)
    want = out.numel() * sdt.itemsize
    np_dtype, is_view = _NP[dtype_name(out)]
    dst = (out.view(torch.int16) if is_view else out).numpy().reshape(-1)
    if codec == "raw":
        data = buf
    elif codec in ("zstd", "shuf+zstd"):
        declared = zstandard.frame_content_size(buf)
        if declared != want:
            raise ValueError(f"zstd frame declares {declared} bytes, manifest {want}")
        data = zstandard.ZstdDecompressor().decompress(buf, max_output_size=want)
    else:
        raise ValueError(f"unknown codec {codec!r}")
    got = memoryview(data).nbytes
    if got != want:
        raise ValueError(f"payload holds {got} bytes, manifest {want}")
    if codec == "shuf+zstd":
        _unshuffle_into(np.frombuffer(data, np.uint8).reshape(sdt.itemsize, -1), sdt, dst)
    else:
        np.copyto(dst, np.frombuffer(data, sdt), casting="safe")
    return out


def _unshuffle_into(planes: np.ndarray, sdt: np.dtype, dst: np.ndarray) -> None:
    """Reassemble byte planes [itemsize, n] (little-endian) straight into dst, widening
    unsigned narrowed integers on the way: two vector passes instead of transpose + cast."""
    k = sdt.itemsize
    if sdt.kind != "u" and dst.itemsize != k:  # narrowed signed ints need sign extension
        np.copyto(dst, planes.T.copy().view(sdt).reshape(-1), casting="safe")
        return
    acc = dst.view(f"<u{k}") if dst.itemsize == k else dst
    np.left_shift(planes[k - 1], 8 * (k - 1), out=acc, dtype=acc.dtype)
    for i in range(k - 2, -1, -1):
        if i:
            np.bitwise_or(acc, np.left_shift(planes[i], 8 * i, dtype=acc.dtype), out=acc)
        else:
            np.bitwise_or(acc, planes[0], out=acc, dtype=acc.dtype)


def torch_dtype(name: str) -> torch.dtype:
    if name not in _NP:
        raise ValueError(f"unknown dtype {name!r}; supported: {sorted(_NP)}")
    return getattr(torch, name)


def itemsize(stored_dtype: str) -> int:
    return np.dtype(stored_dtype).itemsize
