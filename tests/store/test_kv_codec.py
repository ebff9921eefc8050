"""Per-context K/V codecs through the store, and the format-version rule (refuse, never misread)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from ctxcache.store import ArtifactStore, FormatMismatch, StoreConfig
from ctxcache.store.keys import ManifestKey
from ctxcache.kv_codec import decode_kv, encode_kv
from store_helpers import assert_same, make_artifact

CFG = StoreConfig(map_size_bytes=1 << 26, budget_bytes=1 << 26)


@pytest.mark.parametrize("n", [128, 200])  # a whole and a partial key group
def test_int8_round_trip_within_half_a_step(n: int) -> None:
    g = torch.Generator().manual_seed(0)
    k = (torch.randn(2, n, 16, generator=g) * torch.linspace(0.1, 8, 16)).half()  # outlier channels
    v = torch.randn(2, n, 16, generator=g).half()
    k[:, 0] *= 20  # a sink-like token: its group only may lose resolution
    parts = dict(encode_kv(k, v, "int8"))
    assert parts["k"].dtype == parts["v"].dtype == torch.int8
    assert parts["k_scale"].shape == (2, -(-n // 128), 16) and parts["v_scale"].shape == (2, n)
    k2, v2 = decode_kv(parts, "int8", torch.float16)
    ks = parts["k_scale"].float().repeat_interleave(128, dim=1)[:, :n]
    assert ((k2.float() - k.float()).abs() <= ks * 0.5 + k.float().abs() * 2e-3 + 1e-4).all()
    assert ((v2.float() - v.float()).abs() <= parts["v_scale"].float()[..., None] * 0.5 + v.float().abs() * 2e-3 + 1e-4).all()
    err = (k2.float() - k.float()).abs()
    if n > 128:  # the sink's group lost resolution, the next group did not
        assert err[:, 128:].max() < 0.25 * err[:, :128].max()


def test_codec_is_recorded_and_int8_halves_the_kv(tmp_path: Path) -> None:
    art = make_artifact(n=256, d=64)
    with ArtifactStore(tmp_path, CFG) as s:
        lossless = s.put("a", art)
        assert_same(art, s.get("a"))
        coded = s.put("b", replace(art, kv_codec="int8"))
        got = s.get("b")
    assert (lossless.kv_codec, coded.kv_codec, got.kv_codec) == ("lossless", "int8", "int8")
    kv = lambda m: sum(c.stored_bytes for c in m.chunks if c.name[0] in "kv")  # noqa: E731
    assert kv(coded) < 0.55 * kv(lossless)
    assert got.layers[0].k.dtype == torch.float16 and got.layers[0].k.shape == art.layers[0].k.shape
    torch.testing.assert_close(got.layers[1].v.float(), art.layers[1].v.float(), atol=0.05, rtol=0.02)


def _rewrite_manifest(store: ArtifactStore, cid: str, edit) -> None:  # noqa: ANN001
    """Write the manifest as another version of the code would have (edit its JSON body)."""
    import hashlib
    key = ManifestKey(cid).to_string().encode()
    with store._env.begin(write=True) as txn:
        body = json.loads(bytes(txn.get(key)).partition(b"\n")[2])
        edit(body)
        text = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        txn.put(key, hashlib.sha256(text).hexdigest().encode() + b"\n" + text)


def test_store_format_1_manifest_is_still_served(tmp_path: Path) -> None:
    art = replace(make_artifact(), format_version=1)
    with ArtifactStore(tmp_path, CFG) as s:
        s.put("old", art)
        _rewrite_manifest(s, "old", lambda b: (b.pop("kv_codec"), b.update(store_format=1)))
        got = s.get("old")
    assert_same(art, got)
    assert got.kv_codec == "lossless" and got.format_version == 1


@pytest.mark.parametrize("field, value", [("format_version", 7), ("store_format", 9)])
def test_unknown_versions_are_refused_by_name(tmp_path: Path, field: str, value: int) -> None:
    with ArtifactStore(tmp_path, CFG) as s:
        s.put("new", make_artifact())
        _rewrite_manifest(s, "new", lambda b: b.update({field: value}))
        with pytest.raises(FormatMismatch, match=f"{field}={value}"):
            s.get("new")
        with pytest.raises(FormatMismatch, match=f"{field}={value}"):
            s.manifest("new")


@pytest.mark.parametrize("n", [96, 77])  # whole and partial 32-token groups
def test_int4_round_trip_within_half_a_step(n: int) -> None:
    g = torch.Generator().manual_seed(1)
    k = (torch.randn(2, n, 64, generator=g) * torch.linspace(0.1, 8, 64) + 3).half()
    v = torch.randn(2, n, 64, generator=g).half()
    parts = dict(encode_kv(k, v, "int4"))
    assert parts["k"].dtype == torch.uint8 and parts["k"].shape == (2, 64, -(-n // 32), 16)
    assert parts["v"].shape == (2, n, 2, 16) and parts["v_scale"].shape == (2, n, 2)
    k2, v2 = decode_kv(parts, "int4", torch.float16)
    assert k2.shape == k.shape and v2.shape == v.shape
    kstep = parts["k_scale"].float().repeat_interleave(32, dim=2)[..., :n].transpose(1, 2)
    vstep = parts["v_scale"].float().repeat_interleave(32, dim=2)
    assert ((k2.float() - k.float()).abs() <= kstep * 0.5 + k.float().abs() * 2e-3 + 1e-3).all()
    assert ((v2.float() - v.float()).abs() <= vstep * 0.5 + v.float().abs() * 2e-3 + 1e-3).all()
    stored = sum(t.numel() * t.element_size() for t in parts.values())
    assert stored <= (0.3125 if n % 32 == 0 else 0.36) * (k.numel() + v.numel()) * 2  # 4 bits + 2 fp16 per 32
