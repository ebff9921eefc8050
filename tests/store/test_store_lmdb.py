"""ArtifactStore against a real LMDB in a temp dir: round trip, corruption, sizes, eviction."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import lmdb
import numpy as np
import pytest
import torch

from ctxcache.store import (ArtifactStore, ChunkKey, ContextMeta, CorruptArtifact, StoreClosed,
                            StoreConfig, StoreFull)
from store_helpers import assert_same, make_artifact


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def open_store(path: Path, clock: Clock | None = None, **kw: object) -> ArtifactStore:
    cfg = StoreConfig(**{"map_size_bytes": 64 << 20, "budget_bytes": 48 << 20,
                         "access_granularity_s": 0.0, "sync": False, **kw})
    return ArtifactStore(path, cfg, clock or Clock())


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_round_trip_is_bit_exact(store_dir: Path, kv_dtype: torch.dtype) -> None:
    art = make_artifact(3, kv_dtype=kv_dtype)
    art.layers[1].tables["zeros"] = torch.zeros(4, 100, dtype=torch.int32)  # compresses
    with open_store(store_dir) as s:
        m = s.put("ctx-1", art, ContextMeta(labels={"team": "a"}, tenant="t1", prompt_hash="p1"))
        got = s.get("ctx-1")
    assert_same(art, got)
    assert m.raw_kv_bytes == art.kv_bytes() and m.n_tokens == art.n_tokens
    codecs = {c.label(): c.codec for c in m.chunks}
    assert codecs["1:t_zeros"] != "raw"  # zeros must compress
    if kv_dtype == torch.float16:
        assert codecs["0:k"] == "raw"  # random fp16 does not shrink by min_gain
    for c in m.chunks:  # whatever was compressed saved at least min_gain of its narrowed bytes
        narrowed = int(np.prod(c.shape)) * np.dtype(c.stored_dtype).itemsize
        assert c.codec == "raw" or c.stored_bytes <= 0.9 * narrowed, c
    with open_store(store_dir) as s:  # survives reopening
        assert_same(art, s.get("ctx-1"))
        assert s.manifest("ctx-1").labels == {"team": "a"}


def test_missing_and_bad_ids(store_dir: Path) -> None:
    with open_store(store_dir) as s:
        assert s.get("nope") is None and s.manifest("nope") is None
        assert not s.delete("nope")
        assert not s.verify("nope").found
        with pytest.raises(ValueError, match="context_id"):
            s.get("a:b")


def _chunk_key(cid: str, layer: int | None, name: str) -> bytes:
    return ChunkKey(cid, layer, name).to_string().encode()


def test_flipped_byte_on_disk_is_reported(store_dir: Path) -> None:
    art = make_artifact(4)
    with open_store(store_dir) as s:
        s.put("c", art)
    data = store_dir / "data.mdb"
    blob = bytearray(data.read_bytes())
    needle = art.layers[1].v.numpy().tobytes()[:64]
    at = blob.find(needle)
    assert at >= 0 and blob.find(needle, at + 1) < 0
    blob[at + 10] ^= 0x40
    data.write_bytes(bytes(blob))
    with open_store(store_dir) as s:
        report = s.verify("c")
        assert not report.ok and [b.chunk for b in report.bad] == ["1:v"]
        assert "sha256" in report.bad[0].reason
        with pytest.raises(CorruptArtifact) as err:
            s.get("c")
        assert err.value.context_id == "c" and err.value.chunk == "1:v"


def test_size_mismatch_and_missing_chunk(store_dir: Path) -> None:
    with open_store(store_dir) as s:
        s.put("c", make_artifact(5))
        s.put("d", make_artifact(6))
    env = lmdb.open(str(store_dir), map_size=64 << 20)
    with env.begin(write=True) as txn:
        key = _chunk_key("c", 0, "k")
        txn.put(key, txn.get(key)[:-2])
        txn.delete(_chunk_key("d", None, "tokens"))
    env.close()
    with open_store(store_dir) as s:
        assert "stored size" in s.verify("c").bad[0].reason
        assert s.verify("d").bad[0].reason == "chunk is missing"
        for cid, chunk in (("c", "0:k"), ("d", "ctx:tokens")):
            with pytest.raises(CorruptArtifact, match=chunk):
                s.get(cid)


def test_corrupt_manifest_is_typed_and_deletable(store_dir: Path) -> None:
    with open_store(store_dir) as s:
        s.put("c", make_artifact(5))
    env = lmdb.open(str(store_dir), map_size=64 << 20)
    with env.begin(write=True) as txn:
        key = b"ctxcache:v1:manifest:c"
        raw = bytearray(txn.get(key))
        raw[-5] ^= 1
        txn.put(key, bytes(raw))
    env.close()
    with open_store(store_dir) as s:
        with pytest.raises(CorruptArtifact, match="manifest"):
            s.get("c")
        assert s.list_manifests() == [] and s.stats().corrupt_manifests == 1
        assert s.verify("c").bad[0].chunk == "manifest"
        assert s.evict_expired() == [] and s.context_ids() == ["c"]  # kept for verify to report
        assert s.delete("c") and s.context_ids() == []


def test_ttl_expiry(store_dir: Path) -> None:
    clock = Clock()
    with open_store(store_dir, clock) as s:
        s.put("short", make_artifact(1), ContextMeta(ttl_s=10))
        s.put("pinned", make_artifact(2), ContextMeta(ttl_s=10, pinned=True))
        s.put("forever", make_artifact(3))
        clock.t += 9.9
        assert s.get("short") is not None and s.evict_expired() == []
        clock.t += 0.2
        assert s.get("short") is None and s.manifest("short") is None
        assert [m.context_id for m in s.list_manifests()] == ["forever", "pinned"]
        assert s.evict_expired() == ["short"]
        assert s.context_ids() == ["forever", "pinned"]
        s.update_meta("forever", ttl_s=5)
        clock.t += 5
        assert s.evict_expired() == ["forever"]


def test_lru_eviction_under_budget_respects_pin(store_dir: Path) -> None:
    clock = Clock()
    size = open_store(store_dir / "probe").put("x", make_artifact(0)).stored_bytes
    with open_store(store_dir, clock, budget_bytes=int(3.5 * size)) as s:
        for i, cid in enumerate(["a", "b", "c"]):
            clock.t += 1
            s.put(cid, make_artifact(i), ContextMeta(pinned=(cid == "b")))
        clock.t += 1
        s.get("a")  # a is now more recent than c
        clock.t += 1
        s.put("d", make_artifact(9))
        assert s.context_ids() == ["a", "b", "d"]  # c was least recently used; b is pinned
        clock.t += 1
        s.put("e", make_artifact(8))
        assert s.context_ids() == ["b", "d", "e"]
        st = s.stats()
        assert st.contexts == 3 and st.pinned == 1 and st.stored_bytes <= st.budget_bytes
        with pytest.raises(StoreFull, match="budget"):
            s.put("huge", make_artifact(7, n=4096))
        assert s.evict_to_budget() == [] and s.context_ids() == ["b", "d", "e"]
        assert s.evict_to_budget(2 * size) == ["d"]  # least recently used first
        assert s.evict_to_budget(0) == ["e"] and s.context_ids() == ["b"]  # pinned stays


def test_map_full_evicts_lru_then_store_full(store_dir: Path) -> None:
    # Many tiny chunks: LMDB's page overhead fills the 1 MiB map long before the budget (which
    # counts chunk bytes) is reached, so every eviction here answers a MapFullError.
    art = make_artifact(0, n=4, layers=30, hkv=1, d=4, lists=2)
    clock = Clock()
    with open_store(store_dir, clock, map_size_bytes=1 << 20, budget_bytes=1 << 20) as s:
        for i in range(40):
            clock.t += 1
            s.put(f"c{i:02d}", art)
        ids = s.context_ids()
        assert s.stats().stored_bytes < (1 << 20) // 4  # the budget never forced anything
        assert 3 <= len(ids) < 40 and ids == [f"c{i:02d}" for i in range(40 - len(ids), 40)]
        assert_same(art, s.get("c39"))
        # pinning rewrites manifests, which may itself need room: unpinned LRU contexts go
        pinned = [cid for cid in ids[:-1] if s.update_meta(cid, pinned=True) is not None]
        assert len(pinned) >= 2 and s.context_ids() == sorted(pinned + ["c39"])
        clock.t += 1
        s.put("new", art)  # only c39 is unpinned: if anything must go, it does
        assert set(pinned) < set(s.context_ids()) and "new" in s.context_ids()
        s.update_meta("new", pinned=True)
        pinned.append("new")
        with pytest.raises(StoreFull, match="map"):
            for i in range(40):
                s.put(f"more{i}", art, ContextMeta(pinned=True))
        kept = s.context_ids()
        assert set(pinned) <= set(kept)  # nothing pinned was evicted
        assert all(s.verify(cid).ok for cid in kept)  # and nothing partial was left


def test_list_filters_and_paging(store_dir: Path) -> None:
    with open_store(store_dir) as s:
        for i in range(7):
            s.put(f"id{i}", make_artifact(i, n=8, layers=1),
                  ContextMeta(labels={"parity": str(i % 2)}, tenant="t" if i < 3 else "u"))
        assert [m.context_id for m in s.list_manifests(offset=2, limit=3)] == ["id2", "id3", "id4"]
        assert [m.context_id for m in s.list_manifests(labels={"parity": "1"})] == \
            ["id1", "id3", "id5"]
        assert [m.context_id for m in s.list_manifests(tenant="t", after="id0")] == ["id1", "id2"]
        with pytest.raises(ValueError, match="offset"):
            s.list_manifests(offset=-1)


def test_replace_drops_old_chunks(store_dir: Path) -> None:
    with open_store(store_dir) as s:
        s.put("c", make_artifact(1, layers=3))
        small = make_artifact(2, layers=1)
        s.put("c", small)
        assert_same(small, s.get("c"))
    env = lmdb.open(str(store_dir), map_size=64 << 20)
    with env.begin() as txn:
        chunks = [k for k, _ in txn.cursor() if k.startswith(b"ctxcache:v1:chunk:c:")]
    env.close()
    assert len(chunks) == len(s_manifest_chunks(store_dir, "c"))


def s_manifest_chunks(path: Path, cid: str) -> tuple:
    with open_store(path) as s:
        return s.manifest(cid).chunks


def _use_in_child(store: ArtifactStore, q: mp.Queue) -> None:
    try:
        store.get("c")
        q.put("no error")
    except StoreClosed as exc:
        q.put(str(exc))


def test_store_refuses_use_across_fork_and_after_close(store_dir: Path) -> None:
    s = open_store(store_dir)
    s.put("c", make_artifact(1))
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_use_in_child, args=(s, q))
    p.start()
    p.join(30)
    assert "after fork" in q.get(timeout=5)
    s.close()
    with pytest.raises(StoreClosed):
        s.get("c")


def test_stats_report_artifact_vs_kv_bytes(store_dir: Path) -> None:
    art = make_artifact(1)
    with open_store(store_dir) as s:
        m = s.put("c", art)
        st = s.stats()
    assert st.raw_kv_bytes == art.kv_bytes() and st.raw_table_bytes == art.table_bytes()
    assert st.stored_bytes == m.stored_bytes
    assert st.stored_over_kv == pytest.approx(m.stored_bytes / art.kv_bytes())


def test_concurrent_readers_see_whole_artifacts_or_none(store_dir: Path) -> None:
    """Readers racing a writer that replaces, deletes and evicts: every get returns a complete,
    bit-exact artifact or None (what a stream sees before its first token), never a mix."""
    import threading

    arts = [make_artifact(i, n=256, layers=3) for i in range(3)]
    by_first = {int(a.tokens[0]): a for a in arts}
    assert len(by_first) == 3
    s = ArtifactStore(store_dir, StoreConfig(map_size_bytes=64 << 20, budget_bytes=250_000,
                                             sync=False))  # ~2 of the 3 fit: puts evict
    stop, seen, errors = threading.Event(), {"whole": 0, "none": 0}, []

    def reader() -> None:
        while not stop.is_set():
            for cid in ("a", "b", "c"):
                try:
                    got = s.get(cid)
                    if got is None:
                        seen["none"] += 1
                        continue
                    assert_same(by_first[int(got.tokens[0])], got)
                    seen["whole"] += 1
                except Exception as exc:  # noqa: BLE001 (reported below)
                    errors.append(exc)

    threads = [threading.Thread(target=reader) for _ in range(4)]
    for t in threads:
        t.start()
    for i in range(60):
        cid = "abc"[i % 3]
        if i % 5 == 4:
            s.delete(cid)
        else:
            s.put(cid, arts[i % 3 if i % 2 else (i + 1) % 3])
    stop.set()
    for t in threads:
        t.join()
    s.close()
    assert not errors, errors[:3]
    assert seen["whole"] > 0 and seen["none"] > 0


def test_put_writes_what_encode_artifact_encodes(store_dir: Path) -> None:
    """put encodes while it writes (ChunkStream): the manifest and the stored chunks are the
    ones the encode-then-write path (encode_artifact + put_encoded, the object tier's) makes."""
    from concurrent.futures import ThreadPoolExecutor

    from ctxcache.store.chunk_io import encode_artifact

    art = make_artifact(5)
    art.layers[0].tables["zeros"] = torch.zeros(8, 64, dtype=torch.int32)  # a compressed chunk too
    with open_store(store_dir) as s, ThreadPoolExecutor(2) as pool:
        got = s.put("ctx-s", art)
        want, _ = encode_artifact("ctx-s", art, ContextMeta(), s.config, pool, got.created_at)
        assert got.chunks == want.chunks and got.stored_bytes == want.stored_bytes
        assert s.verify("ctx-s").ok
        assert_same(art, s.get("ctx-s"))


def test_put_fits_by_encoded_size_when_raw_does_not(store_dir: Path) -> None:
    """Room is made for the raw bytes first; an artifact over the budget raw but under it
    encoded (zero K/V compress) is still stored, by its exact size."""
    art = make_artifact(6, n=4096)
    for layer in art.layers:
        layer._k.zero_()
        layer._v.zero_()
    raw = sum(c.raw_bytes for c in open_store(store_dir / "probe").put("p", art).chunks)
    with open_store(store_dir, budget_bytes=raw // 2) as s:
        m = s.put("zeros", art)
        assert m.stored_bytes < raw // 2 < raw
        assert_same(art, s.get("zeros"))
