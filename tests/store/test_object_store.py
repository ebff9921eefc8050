"""ObjectArtifactStore on a real folder and a real S3 server: bit-exact round trips, damage and
truncation refused before use, manifest last, delete / TTL / pin / budget, garbage collection."""

from __future__ import annotations

import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from ctxcache.store import ArtifactStore, ContextMeta, CorruptArtifact, StoreFull
from ctxcache.store.object import object_layout as lay
from ctxcache.store.layout import chunk_tensors
from ctxcache.store.object.object_config import ObjectStoreConfig
from ctxcache.store.object.object_store import ObjectArtifactStore
from store_helpers import assert_same, make_artifact


class Clock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def same_stored_bits(a, b) -> None:  # noqa: ANN001 (ContextArtifact)
    """Every tensor the store keeps (coded K/V as codes and scales), bit for bit."""
    ta, tb = chunk_tensors(a), chunk_tensors(b)
    assert [s for s, _ in ta] == [s for s, _ in tb]
    for (slot, x), (_, y) in zip(ta, tb):
        assert x.dtype == y.dtype and x.shape == y.shape, slot
        assert x.contiguous().view(-1).view(torch.uint8).equal(y.contiguous().view(-1).view(torch.uint8)), slot


def chunk_objects(s: ObjectArtifactStore, context_id: str | None = None) -> list[str]:
    return [o.key for o in s.tier.list(lay.CHUNKS)
            if context_id is None or lay.parse_key(o.key).context_id == context_id]


@pytest.mark.parametrize("codec", ["lossless", "int8", "int4"])
def test_round_trip_gives_the_bits_the_lmdb_store_gives(tier_uri: str, tmp_path: Path, codec: str) -> None:
    art = replace(make_artifact(1, n=256, layers=3, d=32), kv_codec=codec)
    with ObjectArtifactStore(tier_uri) as s, ArtifactStore(tmp_path / "lmdb") as local:
        m = s.put("c1", art, ContextMeta(tenant="acme", labels={"k": "v"}))
        local.put("c1", art)
        got, ref = s.get("c1"), local.get("c1")
        same_stored_bits(got, ref)
        if codec == "lossless":
            assert_same(got, art)
        assert s.manifest("c1") == replace(m, last_access=0.0) and m.tenant == "acme"
        assert s.verify("c1").ok and s.context_ids() == ["c1"]


def test_every_object_of_an_artifact_is_named_by_its_context_id_and_written_manifest_last(tier_uri: str) -> None:
    with ObjectArtifactStore(tier_uri) as s:
        order: list[str] = []
        tier = s.tier.inner  # the backend under the guard (tiers/guard.py): batches call its put
        put = tier.put
        tier.put = lambda k, d: (order.append(k), put(k, d))[1]  # type: ignore[method-assign]
        m = s.put("ctx-a", make_artifact(2))
    manifests = [i for i, k in enumerate(order) if k.startswith(lay.MANIFESTS)]
    chunks = [i for i, k in enumerate(order) if k.startswith(lay.CHUNKS)]
    assert len(chunks) == len(m.chunks) and manifests == [max(chunks) + 1]
    assert all(order[i].startswith(f"{lay.CHUNKS}/ctx-a.{lay.write_id(m)}/") for i in chunks)


def _corrupt(s: ObjectArtifactStore, key: str, how: str) -> None:
    data = s.tier.get(key)
    assert data is not None and len(data) > 8
    s.tier.put(key, data[:-5] if how == "truncate" else data[:3] + bytes([data[3] ^ 0x10]) + data[4:])


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_a_damaged_chunk_is_refused_before_use(tier_uri: str, how: str) -> None:
    with ObjectArtifactStore(tier_uri) as s:
        m = s.put("c1", make_artifact(3))
        victim = next(c for c in m.chunks if c.name == "k" and c.layer == 1)
        _corrupt(s, lay.chunk_key("c1", lay.write_id(m), victim), how)
        decoded = []
        s.decode = lambda f: decoded.append(f)  # type: ignore[method-assign]  # nothing may reach it
        with pytest.raises(CorruptArtifact, match="chunk 1:k: " + ("xxh3 checksum" if how == "flip" else "stored size")):
            s.get("c1")
        assert decoded == []
        report = s.verify("c1")
        assert not report.ok and [b.chunk for b in report.bad] == ["1:k"]


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_a_damaged_manifest_is_corruption_not_absence(tier_uri: str, how: str) -> None:
    with ObjectArtifactStore(tier_uri) as s:
        s.put("c1", make_artifact(4))
        _corrupt(s, lay.manifest_key("c1"), how)
        with pytest.raises(CorruptArtifact, match="chunk manifest: unreadable manifest: manifest checksum"):
            s.get("c1")
        assert s.list_manifests() == [] and s.context_ids() == ["c1"]  # listed as present, served as damaged
        assert s.delete("c1") and s.tier.list(lay.VERSION) == []


def test_a_writer_that_dies_before_its_manifest_leaves_nothing_visible_and_gc_removes_it(tier_uri: str) -> None:
    with ObjectArtifactStore(tier_uri) as s:
        s.put("keep", make_artifact(5))
        put = s.tier.put

        def crash_at_manifest(key: str, data: bytes) -> None:
            if key.startswith(lay.MANIFESTS):
                raise KeyboardInterrupt("killed")  # the process dies between chunks and manifest
            put(key, data)

        s.tier.put = crash_at_manifest  # type: ignore[method-assign]
        with pytest.raises(KeyboardInterrupt):
            s.put("torn", make_artifact(6))
        s.tier.put = put  # type: ignore[method-assign]
        assert s.get("torn") is None and s.manifest("torn") is None
        assert s.context_ids() == ["keep"] and [m.context_id for m in s.list_manifests()] == ["keep"]
        torn = chunk_objects(s, "torn")
        assert torn
        assert s.gc(grace_s=3600).orphan_chunks == 0  # young: its writer may still be running
        report = s.gc(grace_s=0)
        assert report.orphan_chunks == len(torn) and report.orphan_bytes > 0
        assert chunk_objects(s, "torn") == []
        assert [f.key for f in s.tier.folders(lay.CHUNKS)] == [lay.folder_of(s.manifest("keep"))]
        assert_same(s.get("keep"), make_artifact(5))


def test_a_writer_killed_between_chunks_and_manifest_leaves_only_orphans(tier_uri: str) -> None:
    writer = Path(__file__).with_name("object_crash_writer.py")
    proc = subprocess.run([sys.executable, str(writer), tier_uri, "torn"], timeout=120)
    assert proc.returncode == -signal.SIGKILL
    with ObjectArtifactStore(tier_uri) as s:
        assert s.get("torn") is None and s.context_ids() == [] and s.list_manifests() == []
        assert len(chunk_objects(s, "torn")) == len(make_artifact(77).layers) * 6 + 2
        assert s.gc(grace_s=0).orphan_chunks == len(make_artifact(77).layers) * 6 + 2
        assert s.tier.list(lay.CHUNKS) == []


def test_replacing_an_artifact_reads_the_new_write_and_drops_the_old_chunks(tier_uri: str) -> None:
    clock = Clock()
    with ObjectArtifactStore(tier_uri, clock=clock) as s:
        old = s.put("c1", make_artifact(7))
        clock.t += 1
        new = s.put("c1", make_artifact(8))
        assert lay.write_id(old) != lay.write_id(new)
        assert_same(s.get("c1"), make_artifact(8))
        assert sorted(chunk_objects(s)) == sorted(lay.chunk_keys(new))


def test_delete_removes_every_object_of_the_context(tier_uri: str) -> None:
    with ObjectArtifactStore(tier_uri) as s:
        s.put("a", make_artifact(9))
        s.put("b", make_artifact(10))
        assert s.delete("a") and not s.delete("a")
        assert s.get("a") is None and s.context_ids() == ["b"]
        assert not [o.key for o in s.tier.list(lay.VERSION) if lay.parse_key(o.key).context_id == "a"]


def test_ttl_and_pin_act_on_the_shared_copy(tier_uri: str) -> None:
    clock = Clock()
    with ObjectArtifactStore(tier_uri, clock=clock) as s:
        s.put("short", make_artifact(11), ContextMeta(ttl_s=10))
        s.put("pinned", make_artifact(12), ContextMeta(ttl_s=10, pinned=True))
        s.put("later", make_artifact(13), ContextMeta(ttl_s=10))
        clock.t += 5
        assert s.update_meta("later", ttl_s=100).ttl_s == 105  # counted from now
        clock.t += 6
        assert s.get("short") is None and s.manifest("short") is None
        assert [m.context_id for m in s.list_manifests()] == ["later", "pinned"]
        assert s.gc(grace_s=3600).expired == ("short",)
        assert s.context_ids() == ["later", "pinned"] and chunk_objects(s, "short") == []
        assert s.update_meta("pinned", pinned=False).pinned is False
        assert s.evict_expired() == ["pinned"]


def test_the_budget_evicts_least_recently_used_unpinned_contexts(tier_uri: str) -> None:
    clock = Clock()
    size = make_artifact(0).kv_bytes() * 1.2
    with ObjectArtifactStore(tier_uri, ObjectStoreConfig(budget_bytes=int(size * 3), access_granularity_s=0),
                             clock=clock) as s:
        for i, cid in enumerate(("old", "pin", "used")):
            s.put(cid, make_artifact(20 + i), ContextMeta(pinned=cid == "pin"))
            clock.t += 10
        s.touch("old")
        s.put("new", make_artifact(30))
        assert s.context_ids() == ["new", "old", "pin"]  # "used" was least recently used
        assert s.evict_to_budget(1) == ["new", "old"]  # pinned stays, even over the budget
        with pytest.raises(StoreFull, match="shared store budget"):
            s.put("huge", make_artifact(31, n=4096))


def test_listing_filters_by_tenant_and_labels_and_pages(tier_uri: str) -> None:
    with ObjectArtifactStore(tier_uri) as s:
        for i in range(5):
            s.put(f"c{i}", make_artifact(40 + i, n=16, layers=1),
                  ContextMeta(tenant="t1" if i % 2 else "t2", labels={"n": str(i)}))
        assert [m.context_id for m in s.list_manifests(tenant="t1")] == ["c1", "c3"]
        assert [m.context_id for m in s.list_manifests(labels={"n": "4"})] == ["c4"]
        assert [m.context_id for m in s.list_manifests(after="c1", limit=2)] == ["c2", "c3"]
        assert [m.context_id for m in s.list_manifests(offset=3)] == ["c3", "c4"]
        assert s.stats().contexts == 5


def test_a_load_decodes_each_chunk_as_it_arrives_and_keeps_every_fetched_chunk(tmp_path: Path, monkeypatch) -> None:
    """fetch_decoded: a chunk is decoded on the thread that read it while a slow chunk is still
    on its way (the decode overlaps the download); the fetched bytes hold the query chunks too
    (for the whole local copy), the artifact only what a load reads; a raw chunk is read straight
    into its tensor (the fetched bytes are the tensor's memory: no copy)."""
    import threading
    import time

    import numpy as np

    from ctxcache.store import chunk_io

    art = make_artifact(4, n=256, layers=3, d=32)
    with ObjectArtifactStore(f"file://{tmp_path}") as s:
        s.put("c1", art)
        slow_key = chunk_objects(s, "c1")[-1]
        inner = s.tier.inner
        real_open = inner.open_object
        decoded_before_slow: list[bool] = []
        slow_done = threading.Event()

        def open_object(key: str):  # noqa: ANN202 - a chunk's ranges are read once it is open
            if key == slow_key:
                time.sleep(0.3)
                got = real_open(key)
                slow_done.set()
                return got
            return real_open(key)

        real_put = chunk_io.ChunkDecoder.put

        def put(self, i, buf):  # noqa: ANN001, ANN202
            decoded_before_slow.append(not slow_done.is_set())
            return real_put(self, i, buf)

        monkeypatch.setattr(inner, "open_object", open_object)
        monkeypatch.setattr(chunk_io.ChunkDecoder, "put", put)
        f, got = s.fetch_decoded("c1", fetch_queries=True, decode_queries=False)
        assert slow_done.is_set() and any(decoded_before_slow) and not all(decoded_before_slow)
        assert len(f.chunks) == len(f.payloads)
        assert_same(got, art)
        tensor_at = {t.data_ptr() for _, t in chunk_tensors(got) if t.numel()}
        in_place = [c.name for c, p in zip(f.chunks, f.payloads) if np.frombuffer(p, np.uint8).ctypes.data in tensor_at]
        assert in_place and all(c.codec == "raw" for c in f.chunks if c.name in in_place), in_place
