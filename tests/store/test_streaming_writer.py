"""The object store's streaming writer (object_writer.py): layers uploaded as they are handed
over, the manifest (naming its write id) last, bytes in flight bounded, a given-up write
removed; and artifacts of the old layout (write id derived from the manifest) still served."""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from ctxcache.store import ArtifactStore, ContextMeta
from ctxcache.store.chunk_io import encode_artifact
from ctxcache.store.config import StoreConfig
from ctxcache.store.keys import GLOBAL_LAYER
from ctxcache.store.object import object_layout as lay
from ctxcache.store.object.object_config import ObjectStoreConfig
from ctxcache.store.object.object_store import ObjectArtifactStore
from store_helpers import assert_same, make_artifact


def chunk_keys_now(s: ObjectArtifactStore) -> list[str]:
    return [o.key for o in s.tier.list(lay.CHUNKS)]


def test_handed_over_layers_are_up_before_finish_and_load_byte_identical(tier_uri: str, tmp_path: Path) -> None:
    art = make_artifact(21, n=256, layers=3, d=32)
    with ObjectArtifactStore(tier_uri) as s, ArtifactStore(tmp_path / "lmdb") as local:
        w = s.writer("c1", ContextMeta(tenant="t"))
        w.add_layer(0, art.layers[0], art.kv_codec)
        deadline = time.monotonic() + 10
        while len(chunk_keys_now(s)) < 6 and time.monotonic() < deadline:  # k, v and 4 tables
            time.sleep(0.02)
        up = chunk_keys_now(s)
        assert len(up) == 6 and all(k.startswith(lay.write_folder("c1", w.write_id) + "/0.") for k in up)
        assert s.manifest("c1") is None and s.context_ids() == []  # nothing visible before finish
        for i in (1, 2):
            w.add_layer(i, art.layers[i], art.kv_codec)
        m = w.finish(art)
        assert m.store_format == 3 and m.write_id == w.write_id and s.manifest("c1") == replace(m, last_access=0.0)
        assert sorted(chunk_keys_now(s)) == sorted(lay.chunk_keys(m))
        with ObjectArtifactStore(tier_uri) as fresh:  # a reader that never saw the write
            assert_same(fresh.get("c1"), art)
            assert fresh.verify("c1").ok
        ref = local.put("c1", art)  # the one-shot encoding of the same artifact: the same bytes
        assert [(c.label(), c.sha256, c.stored_bytes) for c in m.chunks] == \
               [(c.label(), c.sha256, c.stored_bytes) for c in ref.chunks]


def test_a_finish_given_other_tensors_than_handed_over_stores_the_finished_ones(tier_uri: str) -> None:
    a, b = make_artifact(22, n=128, layers=2, d=32), make_artifact(23, n=128, layers=2, d=32)
    with ObjectArtifactStore(tier_uri) as s:
        w = s.writer("c1")
        w.add_layer(0, a.layers[0], a.kv_codec)
        w.finish(b)
        assert_same(s.get("c1"), b)
        assert sorted(chunk_keys_now(s)) == sorted(lay.chunk_keys(s.manifest("c1")))


def test_a_layer_handed_over_again_uploads_only_its_new_chunks(tier_uri: str) -> None:
    """A build hands a layer's K/V as its prefill ends, then the layer with its tables."""
    art = make_artifact(25, n=128, layers=2, d=32)
    puts: list[str] = []
    with ObjectArtifactStore(tier_uri) as s:
        put = s.tier.inner.put

        def counted(key: str, data) -> None:  # noqa: ANN001
            puts.append(key)
            put(key, data)
        s.tier.inner.put = counted
        w = s.writer("c1")
        for i, layer in enumerate(art.layers):
            w.add_layer(i, layer.with_tables({}), art.kv_codec)  # the K/V alone
            w.add_layer(i, layer, art.kv_codec)
        m = w.finish(art)
        chunks = [k for k in puts if k.startswith(lay.CHUNKS)]
        assert sorted(chunks) == sorted(lay.chunk_keys(m))  # each once
        assert_same(s.get("c1"), art)


class GatedTier:
    """Holds every chunk PUT until `gate` is set (an object store slower than the build)."""

    def __init__(self, s: ObjectArtifactStore) -> None:
        self.gate, self.started = threading.Event(), threading.Event()
        inner = s.tier.inner
        put = inner.put

        def gated(key: str, data) -> None:  # noqa: ANN001
            if key.startswith(lay.CHUNKS):
                self.started.set()
                assert self.gate.wait(20)
            put(key, data)
        inner.put = gated


def test_a_hand_over_past_the_in_flight_byte_limit_waits_for_the_uploads(tmp_path: Path) -> None:
    art = make_artifact(24, n=256, layers=2, d=32)
    cfg = ObjectStoreConfig(put_inflight_bytes=1)  # one chunk at a time
    with ObjectArtifactStore(f"file://{tmp_path / 'shared'}", cfg) as s:
        tier = GatedTier(s)
        w = s.writer("c1")
        handed = threading.Thread(target=w.add_layer, args=(0, art.layers[0], art.kv_codec))
        handed.start()
        assert tier.started.wait(10)
        handed.join(0.5)
        assert handed.is_alive()  # its second chunk waits: the first holds the limit
        assert w._inflight.held == art.layers[0].k.numel() * art.layers[0].k.element_size()
        tier.gate.set()
        handed.join(10)
        assert not handed.is_alive()
        w.finish(art)
        assert_same(s.get("c1"), art)


def test_an_aborted_write_leaves_nothing(tier_uri: str) -> None:
    art = make_artifact(25, n=128, layers=2, d=32)
    with ObjectArtifactStore(tier_uri) as s:
        w = s.writer("c1")
        w.add_layer(0, art.layers[0], art.kv_codec)
        w.abort()
        assert chunk_keys_now(s) == [] and s.context_ids() == [] and s.get("c1") is None
        with pytest.raises(Exception, match="given up"):
            w.add_layer(1, art.layers[1], art.kv_codec)


# ---- the old layout: format-2 manifests, their write id a hash of the manifest -------------------
def old_write_id(m) -> str:  # noqa: ANN001 (Manifest)
    """The write id the code before store format 3 gave a write (frozen here on purpose)."""
    h = hashlib.sha256(repr(float(m.created_at)).encode())
    for c in m.chunks:
        h.update(f"\0{c.label()}\0{c.sha256}".encode())
    return h.hexdigest()[:20]


def put_old_layout(s: ObjectArtifactStore, cid: str, art) -> object:  # noqa: ANN001
    """Objects as a writer of store format 2 left them: chunks under the hashed write id, then
    the manifest (no write_id in it)."""
    m, payloads = encode_artifact(cid, art, ContextMeta(), StoreConfig(), s._pool, time.time())
    assert m.store_format == 2 and b"write_id" not in m.to_bytes()
    wid = old_write_id(m)
    for c, p in zip(m.chunks, payloads):
        layer = GLOBAL_LAYER if c.layer is None else str(c.layer)
        s.tier.put(f"{lay.CHUNKS}/{cid}.{wid}/{layer}.{c.name}", bytes(p))
    s.tier.put(lay.manifest_key(cid), m.to_bytes())
    return m


def test_an_artifact_in_the_old_layout_still_loads_verifies_and_is_replaced_and_collected(tier_uri: str) -> None:
    old_art, new_art = make_artifact(26, n=128, layers=2, d=32), make_artifact(27, n=128, layers=2, d=32)
    with ObjectArtifactStore(tier_uri) as s:
        put_old_layout(s, "old", old_art)
        put_old_layout(s, "gone", old_art)
        assert_same(s.get("old"), old_art)
        assert s.verify("old").ok and s.manifest("old").store_format == 2
        assert s.gc(grace_s=0).orphan_chunks == 0  # its chunks are named by its manifest
        assert s.delete("gone") and [k for k in chunk_keys_now(s) if "/gone." in k] == []
        new = s.put("old", new_art)  # replaced the new way: the old write's chunks go
        assert sorted(chunk_keys_now(s)) == sorted(lay.chunk_keys(new))
        assert_same(s.get("old"), new_art)
