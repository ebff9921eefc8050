"""Per-context K/V codecs: how a layer's k and v become stored tensors and back.

- "lossless": k and v as they are (the chunk codec byte-shuffles + zstd-compresses them only
  where that pays; fp16 K/V rarely does, so they are stored plain).
- "int8": symmetric int8, KIVI-style axes: keys per channel (outlier channels keep their own
  range) in groups of KEY_GROUP tokens (a sink token's large key does not flatten a whole
  channel), values per token; fp16 scales. 0.52x the fp16 bytes.
- "int4": asymmetric 4-bit (KIVI's layout): keys per channel in groups of INT4_GROUP tokens,
  values per token in groups of INT4_GROUP channels, an fp16 scale and minimum per group, two
  codes per byte. 0.31x the fp16 bytes.
The decoded tensors are `dtype` (the artifact's kv_dtype); decoding is a multiply per element.
Both directions are plain torch ops and run on whichever device holds the tensors: the indexer
encodes on the build's device (a GPU build copies codes, not fp16, to the host) and a runner
decodes on its own (a GPU runner copies codes to HBM and multiplies there). The arithmetic is
the same IEEE fp32 sequence on every device (an int8 * fp16 product is exact in fp32; divisions
and roundings are correctly rounded), so every device yields the host's bits (tests/store/
test_kv_codec.py). No method knowledge here: tables are not touched. No store knowledge either:
the model side (artifact, indexer, decoder) uses this module without importing LMDB.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

KEY_GROUP = 128  # tokens per key scale (per channel); a scale costs 2 bytes per 128 elements
INT4_GROUP = 32  # int4: tokens per key group, channels per value group
SCALE_SUFFIX = "_scale"
MIN_SUFFIX = "_min"


@dataclass(frozen=True)
class CodedKV:
    """One layer's K/V as its codec stores them: `parts` named as `encode_kv` names them (k and v
    codes, scales, minima), on one device; `shape` [Hkv, N, D] and `dtype` of the decoded k and v."""

    codec: str
    parts: dict[str, torch.Tensor]
    shape: tuple[int, int, int]
    dtype: torch.dtype

    @staticmethod
    def encode(k: torch.Tensor, v: torch.Tensor, codec: str) -> "CodedKV":
        """Encode k, v [Hkv, N, D] (their dtype is the decoded dtype) where they are."""
        return CodedKV(codec, dict(encode_kv(k, v, codec)), tuple(k.shape), k.dtype)

    def map(self, fn) -> "CodedKV":
        """The same codes with fn applied to every part (a copy to the host or a device)."""
        return CodedKV(self.codec, {n: fn(t) for n, t in self.parts.items()}, self.shape, self.dtype)

    def decode(self, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) decoded on `device` (default: where the parts are); the parts are copied there
        first (asynchronously from pinned host memory), so the multiply runs on that device."""
        parts = self.parts if device is None else {n: t.to(device, non_blocking=True) for n, t in self.parts.items()}
        return decode_kv(parts, self.codec, self.dtype)

    def decode_into(self, k_out: torch.Tensor, v_out: torch.Tensor) -> None:
        """Decode into k_out, v_out [Hkv, N, D] (any dtype and device). On a GPU, int8 codes of
        the cache's dtype go through one kernel per tensor that reads them where they are (pinned
        host memory over PCIe, zero-copy) and writes the cache once (kernels/load_kernels.py: the
        torch decode was ~8 passes over fp32 temporaries); the same bits as `decode`."""
        if k_out.is_cuda and self.codec == "int8" and k_out.dtype == v_out.dtype:
            from ctxcache.kernels.load_kernels import dequant_into, dequant_ok

            if dequant_ok(self.parts["k"], self.dtype, k_out.dtype):
                p = {n: t if t.is_cuda or t.is_pinned() else t.to(k_out.device) for n, t in self.parts.items()}
                dequant_into(p["k"], p["k" + SCALE_SUFFIX], k_out, KEY_GROUP, self.dtype)
                dequant_into(p["v"], p["v" + SCALE_SUFFIX], v_out, 1, self.dtype)
                return
        k, v = self.decode(k_out.device)
        k_out.copy_(k)
        v_out.copy_(v)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts.values())


def encode_kv(k: torch.Tensor, v: torch.Tensor, codec: str) -> list[tuple[str, torch.Tensor]]:
    """k, v [Hkv, N, D] -> named tensors to store (k and v keep their names)."""
    if codec == "lossless":
        return [("k", k), ("v", v)]
    if codec == "int8":
        kq, ks = quantize_keys(k)
        vq, vs = _quantize(v.float(), dim=-1)
        return [("k", kq), ("k" + SCALE_SUFFIX, ks), ("v", vq), ("v" + SCALE_SUFFIX, vs[..., 0])]
    if codec == "int4":
        kt = _by_token_groups(k.float().transpose(1, 2))  # [Hkv, D, N/G, G]: channel rows, token groups
        out = []
        for name, x in (("k", kt), ("v", _by_token_groups(v.float()))):
            q, scale, lo = _quantize4(x)
            out += [(name, _pack4(q)), (name + SCALE_SUFFIX, scale), (name + MIN_SUFFIX, lo)]
        return out
    raise ValueError(f"unknown kv_codec {codec!r}; known: lossless, int8, int4")


def decode_kv(parts: dict[str, torch.Tensor], codec: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of encode_kv: the stored tensors of one layer -> (k, v) [Hkv, N, D] of dtype."""
    if codec == "lossless":
        return parts["k"].to(dtype), parts["v"].to(dtype)
    if codec == "int8":
        v = parts["v"].float() * parts["v" + SCALE_SUFFIX].float()[..., None]
        return dequantize_keys(parts["k"], parts["k" + SCALE_SUFFIX], dtype), v.to(dtype)
    if codec == "int4":
        k, v = (_unpack4(parts[x]).float() * parts[x + SCALE_SUFFIX].float()[..., None]
                + parts[x + MIN_SUFFIX].float()[..., None] for x in ("k", "v"))
        n = parts["v" + SCALE_SUFFIX].shape[1]
        k = k.flatten(2)[..., :n].transpose(1, 2)  # [Hkv, D, N] -> [Hkv, N, D]
        return k.to(dtype), v.flatten(2)[..., :k.shape[-1]].to(dtype)
    raise ValueError(f"unknown kv_codec {codec!r}; known: lossless, int8, int4")


def _grouped(x: torch.Tensor) -> torch.Tensor:
    """[Hkv, N, D] -> [Hkv, ceil(N/G), G, D], zero-padded at the end."""
    pad = -x.shape[1] % KEY_GROUP
    return F.pad(x, (0, 0, 0, pad)).unflatten(1, (-1, KEY_GROUP))


def quantize_keys(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 codec's keys: k [Hkv, N, D] -> int8 [Hkv, N, D], fp16 scales [Hkv, ceil(N/G), D]
    (per channel per group of KEY_GROUP tokens from position 0; the last group may be short)."""
    q, scale = _quantize(_grouped(k.float()), dim=2)
    return q.flatten(1, 2)[:, :k.shape[1]].contiguous(), scale[:, :, 0]


def dequantize_keys(kq: torch.Tensor, ks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of quantize_keys: int8 [Hkv, N, D] and scales [Hkv, ceil(N/G), D] -> keys of dtype."""
    n = kq.shape[1]
    k = (kq.float().unflatten(1, (-1, KEY_GROUP)) if n % KEY_GROUP == 0 else _grouped(kq.float()))
    return (k * ks.float()[:, :, None]).flatten(1, 2)[:, :n].to(dtype)


def _quantize(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 over `dim`; the scale is rounded to fp16 first, so the stored scale is
    exactly the one the values were divided by."""
    scale = (x.abs().amax(dim, keepdim=True) / 127.0).clamp_min(1e-6).half()
    q = torch.round(x / scale.float()).clamp_(-127, 127).to(torch.int8)
    return q, scale


def _by_token_groups(x: torch.Tensor) -> torch.Tensor:
    """[Hkv, R, L] -> [Hkv, R, ceil(L/G), G] (G = INT4_GROUP), the last group padded by repeating
    the row's last value (so padding never widens a group's range)."""
    pad = -x.shape[-1] % INT4_GROUP
    if pad:
        x = torch.cat([x, x[..., -1:].expand(*x.shape[:-1], pad)], dim=-1)
    return x.unflatten(-1, (-1, INT4_GROUP))


def _quantize4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit over the last dim: -> codes uint8 in [0, 15], fp16 scale and minimum
    [...] (rounded to fp16 before use, so the stored ones are the ones applied)."""
    lo = x.amin(-1).half()
    scale = ((x.amax(-1) - lo.float()) / 15.0).clamp_min(1e-6).half()
    q = torch.round((x - lo.float()[..., None]) / scale.float()[..., None]).clamp_(0, 15).to(torch.uint8)
    return q, scale, lo


def _pack4(q: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., G] (G even) -> [..., G/2], two codes per byte."""
    return (q[..., 0::2] | (q[..., 1::2] << 4)).contiguous()


def _unpack4(p: torch.Tensor) -> torch.Tensor:
    return torch.stack([p & 15, p >> 4], dim=-1).flatten(-2)
