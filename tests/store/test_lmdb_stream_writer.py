"""LMDB's streaming writer (store/lmdb/stream_writer.py, issue 44): each handed-over layer is
committed while the build goes on, the manifest last; nothing visible before it, nothing left
after an abort, a failure or a crash; a re-put replaces in one transaction."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from ctxcache.store import ArtifactStore, ContextMeta, StoreConfig, StoreError, StoreFull
from ctxcache.store.keys import ChunkKey, prefix
from ctxcache.store.errors import WriteStopped
from ctxcache.store.lmdb import stream_writer
from store_helpers import assert_same, make_artifact


def open_store(path: Path, **kw: object) -> ArtifactStore:
    return ArtifactStore(path, StoreConfig(**{"map_size_bytes": 64 << 20, "budget_bytes": 48 << 20,
                                              "sync": False, **kw}))


def chunk_keys(s: ArtifactStore, cid: str) -> list[bytes]:
    head = (prefix(ChunkKey.kind) + cid + ":").encode()
    with s._env.begin() as txn:
        cur = txn.cursor()
        if not cur.set_range(head):
            return []
        return [bytes(k) for k in cur.iternext(values=False) if bytes(k).startswith(head)]


def wait_for_keys(s: ArtifactStore, cid: str, n: int) -> list[bytes]:
    deadline = time.monotonic() + 10
    while len(keys := chunk_keys(s, cid)) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    return keys


def layer_keys(layer: int, art) -> int:  # noqa: ANN001
    return len(art.layers[layer].coded_as(art.kv_codec).parts) + len(art.layers[layer].tables)


def test_layers_are_committed_as_handed_over_and_the_put_round_trips(store_dir: Path) -> None:
    art = make_artifact(1, n=256, layers=3, d=32)
    with open_store(store_dir) as s:
        ref = open_store(store_dir.parent / "ref").put("c1", art)  # the one-transaction put
        w = s.writer("c1", ContextMeta(tenant="t"))
        assert isinstance(w, stream_writer.StreamWriter)
        w.add_layer(0, art.layers[0], art.kv_codec)
        assert len(wait_for_keys(s, "c1", layer_keys(0, art))) == layer_keys(0, art)  # before finish
        # a reader sees nothing of it yet
        assert s.get("c1") is None and s.manifest("c1") is None and s.context_ids() == []
        assert s.list_manifests() == [] and s.stats().contexts == 0 and s.stats().stored_bytes == 0
        assert not s.verify("c1").found
        for i in (1, 2):
            w.add_layer(i, art.layers[i], art.kv_codec)
        m = w.finish(art)
        assert_same(s.get("c1"), art)
        assert s.verify("c1").ok and s.context_ids() == ["c1"] and s.stats().stored_bytes == m.stored_bytes
        assert m.tenant == "t" and [(c.label(), c.sha256) for c in m.chunks] == \
               [(c.label(), c.sha256) for c in ref.chunks]
        assert len(chunk_keys(s, "c1")) == len(m.chunks) and s._streams == {}
    with open_store(store_dir) as s:  # durable, and nothing swept
        assert s.orphans_swept == [] and s.verify("c1").ok


def test_a_layer_handed_over_again_encodes_only_its_new_chunks(store_dir: Path, monkeypatch) -> None:
    """The build hands a layer's K/V as its prefill ends, then the layer with its tables."""
    art = make_artifact(2, n=128, layers=2, d=32)
    encoded: list[int] = []
    encode = stream_writer.codec.encode
    monkeypatch.setattr(stream_writer.codec, "encode", lambda t, *a: encoded.append(1) or encode(t, *a))
    with open_store(store_dir) as s:
        w = s.writer("c1")
        for i, layer in enumerate(art.layers):
            w.add_layer(i, layer.with_tables({}), art.kv_codec)
            w.add_layer(i, layer, art.kv_codec)
        m = w.finish(art)
        assert len(encoded) == len(m.chunks)  # each once, tokens and logits at finish
        assert_same(s.get("c1"), art)


def test_nothing_is_encoded_before_ready(store_dir: Path) -> None:
    art = make_artifact(3, n=128, layers=2, d=32)
    landed = threading.Event()
    with open_store(store_dir) as s:
        w = s.writer("c1")
        w.add_layer(0, art.layers[0], art.kv_codec, lambda: landed.wait(10))
        time.sleep(0.2)
        assert chunk_keys(s, "c1") == []  # its host copies have not landed
        landed.set()
        assert len(wait_for_keys(s, "c1", layer_keys(0, art))) == layer_keys(0, art)
        w.add_layer(1, art.layers[1], art.kv_codec)
        w.finish(art)
        assert_same(s.get("c1"), art)


def test_abort_leaves_no_chunks_and_the_stats_unchanged(store_dir: Path) -> None:
    art, other = make_artifact(4, n=256, layers=3, d=32), make_artifact(5, n=64)
    with open_store(store_dir) as s:
        s.put("keep", other)
        before = s.stats()
        w = s.writer("c1")
        for i in range(2):
            w.add_layer(i, art.layers[i], art.kv_codec)
        n = layer_keys(0, art) + layer_keys(1, art)
        assert len(wait_for_keys(s, "c1", n)) == n
        w.abort()
        w.abort()  # idempotent
        assert chunk_keys(s, "c1") == [] and s.get("c1") is None and s._streams == {}
        after = s.stats()
        assert (after.contexts, after.stored_bytes, after.raw_bytes) == \
               (before.contexts, before.stored_bytes, before.raw_bytes)
        with pytest.raises(WriteStopped):
            w.add_layer(2, art.layers[2], art.kv_codec)
        s.writer("c1").finish(art)  # the id is free again
        assert_same(s.get("c1"), art)
        assert_same(s.get("keep"), other)


def test_an_unfinished_put_is_swept_when_the_store_opens(store_dir: Path) -> None:
    """As after a kill -9: chunk keys, no manifest; the next open deletes them."""
    art, other = make_artifact(6, n=256, layers=3, d=32), make_artifact(7, n=64)
    with open_store(store_dir) as s:
        s.put("keep", other)
        stored = s.stats().stored_bytes
        w = s.writer("c1")
        for i in range(2):
            w.add_layer(i, art.layers[i], art.kv_codec)
        n = layer_keys(0, art) + layer_keys(1, art)
        assert len(wait_for_keys(s, "c1", n)) == n
        del w  # neither finished nor aborted; close() stops its thread and deletes nothing
        assert s.stats().stored_bytes == stored  # not counted meanwhile
    with open_store(store_dir, readonly=True) as ro:  # a read-only open sweeps nothing
        assert ro.orphans_swept == [] and len(chunk_keys(ro, "c1")) == n
        assert ro.context_ids() == ["keep"] and ro.stats().stored_bytes == stored
    with open_store(store_dir) as s:
        assert s.orphans_swept == ["c1"] and chunk_keys(s, "c1") == []
        assert s.context_ids() == ["keep"] and s.verify("keep").ok and s.stats().stored_bytes == stored


def test_a_reput_keeps_serving_the_old_context_until_its_manifest_commits(store_dir: Path) -> None:
    old, new = make_artifact(8, n=256, layers=3, d=32), make_artifact(9, n=256, layers=3, d=32)
    with open_store(store_dir) as s:
        s.put("c1", old)
        w = s.writer("c1")
        assert not isinstance(w, stream_writer.StreamWriter)  # one transaction at finish
        for i, layer in enumerate(new.layers):
            w.add_layer(i, layer, new.kv_codec)
        time.sleep(0.1)
        assert_same(s.get("c1"), old)
        assert s.verify("c1").ok
        m = w.finish(new)
        assert_same(s.get("c1"), new)
        assert s.verify("c1").ok and len(chunk_keys(s, "c1")) == len(m.chunks)


def test_one_put_per_id_at_a_time(store_dir: Path) -> None:
    art = make_artifact(10, n=64)
    with open_store(store_dir) as s:
        w = s.writer("c1")
        for start in (lambda: s.writer("c1"), lambda: s.put("c1", art)):
            with pytest.raises(StoreError, match="being put already"):
                start()
        w.finish(art)
        s.put("c1", art)  # free again


def test_a_delete_during_the_put_fails_it_and_leaves_nothing(store_dir: Path) -> None:
    art = make_artifact(11, n=256, layers=3, d=32)
    with open_store(store_dir) as s:
        w = s.writer("c1")
        w.add_layer(0, art.layers[0], art.kv_codec)
        wait_for_keys(s, "c1", layer_keys(0, art))
        s.delete("c1")
        with pytest.raises(StoreError, match="missing at commit"):
            w.finish(art)
        assert s.manifest("c1") is None and chunk_keys(s, "c1") == [] and s._streams == {}


def test_store_full_mid_stream_aborts_cleanly(store_dir: Path) -> None:
    art, pin = make_artifact(12, n=1024, layers=4, d=32), make_artifact(13, n=1024, layers=4, d=32)
    with open_store(store_dir / "probe") as p:
        size = p.put("p", pin).stored_bytes
    with open_store(store_dir, budget_bytes=size + size // 2) as s:  # room for 1.5 of them
        s.put("pinned", pin, ContextMeta(pinned=True))
        before = s.stats()
        w = s.writer("c1")
        with pytest.raises(StoreFull, match=rf"c1 \(streamed, \d+ bytes so far\).*budget of {size + size // 2}"):
            for i, layer in enumerate(art.layers):
                w.add_layer(i, layer, art.kv_codec)
                time.sleep(0.05)  # the layer's transaction runs meanwhile
            w.finish(art)
        w.abort()  # what the build does on the error raised by add_layer
        assert chunk_keys(s, "c1") == [] and s.manifest("c1") is None and s._streams == {}
        assert s.stats().stored_bytes == before.stored_bytes and s.verify("pinned").ok


def test_the_chunks_of_a_put_in_progress_count_against_the_budget(store_dir: Path) -> None:
    art, other = make_artifact(14, n=1024, layers=4, d=32), make_artifact(15, n=1024, layers=4, d=32)
    with open_store(store_dir / "probe") as p:
        size = p.put("p", art).stored_bytes
    with open_store(store_dir, budget_bytes=size + size // 2) as s:
        w = s.writer("c1")
        for i in range(3):
            w.add_layer(i, art.layers[i], art.kv_codec)
        wait_for_keys(s, "c1", sum(layer_keys(i, art) for i in range(3)))
        with pytest.raises(StoreFull):  # fits the budget alone, not beside c1's 3 layers
            s.put("other", other, ContextMeta(pinned=True))
        w.add_layer(3, art.layers[3], art.kv_codec)
        w.finish(art)
        assert_same(s.get("c1"), art)


def test_map_full_mid_stream_evicts_lru_contexts_and_retries_the_layer(store_dir: Path, monkeypatch) -> None:
    art = make_artifact(16, n=4096, layers=4, d=32)
    with open_store(store_dir, map_size_bytes=6 << 20, budget_bytes=6 << 20) as s:
        olds = [f"old{i}" for i in range(4)]
        for cid in olds:
            s.put(cid, make_artifact(17, n=4096, layers=2, d=32))
        evict, for_map = s._evict_one_for_map, []
        monkeypatch.setattr(s, "_evict_one_for_map", lambda *a: for_map.append(a[0]) or evict(*a))
        w = s.writer("c1")
        for i, layer in enumerate(art.layers):
            w.add_layer(i, layer, art.kv_codec)
        m = w.finish(art)
        assert for_map and set(for_map) == {"c1"}  # the map filled during c1's layer transactions
        assert set(s.context_ids()) < set(olds) | {"c1"} and "c1" in s.context_ids()  # some evicted
        assert_same(s.get("c1"), art)
        assert all(s.verify(cid).ok for cid in s.context_ids()) and m.stored_bytes > 0
