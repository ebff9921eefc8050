"""TieredStore: two workers, each with its own LMDB in front of one object store (a folder or a
real SeaweedFS): read-through, one download per context, deletes seen everywhere, damage
refused, and an object store that stops or hangs."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from ctxcache.store import ArtifactStore, ContextMeta, CorruptArtifact, StoreConfig, StoreUnavailable
from ctxcache.store.object import object_layout as lay
from ctxcache.store.object.object_config import ObjectStoreConfig
from ctxcache.store.tiered_store import TieredConfig, TieredStore, open_store
from ctxcache.store.tiers import TierConfig
from ctxcache.store.tiers.guard import GuardConfig
from store_helpers import assert_same, make_artifact

SMALL = StoreConfig(map_size_bytes=64 << 20, budget_bytes=32 << 20)
FAST = ObjectStoreConfig(tier=TierConfig(deadline_s=4, connect_timeout_s=1, request_timeout_s=2, max_attempts=1),
                         guard=GuardConfig(open_s=0.5))


def worker(tmp_path: Path, name: str, uri: str, **kw) -> TieredStore:
    store = open_store(tmp_path / name, SMALL, uri, FAST, TieredConfig(**kw))
    assert isinstance(store, TieredStore)
    return store


def test_without_an_object_store_the_store_is_todays_lmdb_store(tmp_path: Path) -> None:
    store = open_store(tmp_path / "data", SMALL)
    assert type(store) is ArtifactStore
    store.close()


def test_a_context_put_on_one_worker_loads_on_another_then_from_its_local_copy(tier_uri: str, tmp_path: Path) -> None:
    art = make_artifact(1, n=512, layers=3, d=32)
    with worker(tmp_path, "a", tier_uri) as a, worker(tmp_path, "b", tier_uri) as b:
        m = a.put("c1", art, ContextMeta(tenant="t"))
        a.flush()  # the putter's local copy is written after the upload returned
        assert a.local.manifest("c1") is not None and b.local.manifest("c1") is None
        assert_same(b.get("c1"), art)  # from the object store ...
        b.flush()
        assert b.local.manifest("c1") is not None  # ... kept locally (written after the load returned)
        assert_same(b.get("c1"), art)  # from the local copy
        loads = b.load_stats()
        assert (loads.tiers["object"].hits, loads.tiers["local"].hits) == (1, 1)
        assert loads.tiers["object"].bytes == m.stored_bytes and loads.tiers["object"].bytes_per_s > 0
        assert b.manifest("c1").context_id == "c1" and b.list_manifests()[0].tenant == "t"
        assert b.get("absent") is None and b.load_stats().misses == 1


def test_a_put_is_done_at_its_upload_and_loads_from_its_own_bytes_until_the_local_copy_lands(
        tier_uri: str, tmp_path: Path) -> None:
    art = make_artifact(3, n=256, layers=2, d=32)
    with worker(tmp_path, "a", tier_uri) as a:
        gate = threading.Event()
        a._filler.submit(gate.wait)  # the local write queues behind this
        a.put("c1", art)
        a.shared.fetch = lambda *_, **__: pytest.fail("fetched what the put holds")
        assert a.local.manifest("c1") is None
        assert_same(a.get("c1"), art)  # decoded from the put's encoded bytes
        gate.set()
        a.flush()
        assert a.local.manifest("c1") is not None
        assert_same(a.get("c1"), art)


def test_concurrent_loads_of_one_context_share_one_download(tier_uri: str, tmp_path: Path) -> None:
    art = make_artifact(2, n=512, layers=4, d=32)
    with worker(tmp_path, "a", tier_uri) as a, worker(tmp_path, "b", tier_uri) as b:
        a.put("c1", art)
        fetches = []
        fetch = b.shared.fetch

        def slow_fetch(*args, **kw):  # noqa: ANN002, ANN003, ANN202
            fetches.append(1)
            time.sleep(0.5)  # every other caller arrives while this download runs
            return fetch(*args, **kw)

        b.shared.fetch = slow_fetch  # type: ignore[method-assign]
        got: list = [None] * 6
        threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, b.get("c1"))) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(fetches) == 1 and b.load_stats().shared_downloads == 5
        for g in got:
            assert_same(g, art)


def test_a_load_while_the_local_copy_is_written_decodes_the_downloaded_bytes(tier_uri: str, tmp_path: Path) -> None:
    art = make_artifact(11)
    with worker(tmp_path, "a", tier_uri) as a, worker(tmp_path, "b", tier_uri) as b:
        a.put("c1", art)
        fetches, gate = [], threading.Event()
        fetch, put_encoded = b.shared.fetch, b.local.put_encoded
        b.shared.fetch = lambda *a, **k: (fetches.append(1), fetch(*a, **k))[1]  # type: ignore[method-assign]
        b.local.put_encoded = lambda *a: (gate.wait(10), put_encoded(*a))[1]  # type: ignore[method-assign]
        assert_same(b.get("c1"), art)  # returns before its local copy is written
        assert b.local.manifest("c1") is None
        assert_same(b.get("c1"), art)  # from the bytes held for the writer: no second download
        gate.set()
        b.flush()
        assert len(fetches) == 1 and b.local.manifest("c1") is not None
        assert_same(b.get("c1"), art)
        loads = b.load_stats()
        assert (loads.tiers["object"].hits, loads.tiers["local"].hits) == (2, 1)


def test_a_delete_on_one_worker_is_not_served_from_another_workers_local_copy(tier_uri: str, tmp_path: Path) -> None:
    with worker(tmp_path, "a", tier_uri) as a, worker(tmp_path, "b", tier_uri, confirm_ttl_s=0.3) as b:
        a.put("c1", make_artifact(3))
        a.put("c2", make_artifact(4))
        assert b.get("c1") is not None and b.get("c2") is not None
        b.flush()
        assert b.local.manifest("c1") is not None
        assert a.delete("c1") and a.delete("c2")
        time.sleep(0.3)  # b's last word from the object store holds this long
        assert b.manifest("c1") is None and b.local.manifest("c1") is None
        assert b.get("c2") is None and b.local.manifest("c2") is None
        assert a.shared.tier.list(lay.VERSION) == []


def test_drop_local_forgets_every_copy_this_worker_holds(tier_uri: str, tmp_path: Path) -> None:
    with worker(tmp_path, "a", tier_uri) as a, worker(tmp_path, "b", tier_uri) as b:
        a.put("c1", make_artifact(12))
        gate = threading.Event()
        put_encoded = b.local.put_encoded
        b.local.put_encoded = lambda *a: (gate.wait(10), put_encoded(*a))[1]  # type: ignore[method-assign]
        assert b.get("c1") is not None  # its local copy is not written yet
        a.shared.delete("c1")  # deleted elsewhere; the registry tells b
        assert b.drop_local("c1") is False
        assert b.get("c1") is None  # neither the held download nor a trusted check serves it
        gate.set()
        b.flush()
        assert b.local.manifest("c1") is None


def test_a_damaged_object_is_data_loss_and_never_kept_locally(tier_uri: str, tmp_path: Path) -> None:
    with worker(tmp_path, "a", tier_uri) as a, worker(tmp_path, "b", tier_uri) as b:
        m = a.put("c1", make_artifact(4))
        key = lay.chunk_keys(m)[3]
        a.shared.tier.put(key, a.shared.tier.get(key)[:-1])  # truncated
        with pytest.raises(CorruptArtifact, match="stored size"):
            b.get("c1")
        assert b.local.manifest("c1") is None and b.load_stats().corrupt == 1


def test_a_damaged_local_copy_is_replaced_from_the_object_store(tier_uri: str, tmp_path: Path) -> None:
    art = make_artifact(5)
    with worker(tmp_path, "a", tier_uri) as a:
        m = a.put("c1", art)
        f = a.shared.fetch("c1")
        bad = [bytes(p) for p in f.payloads]
        bad[2] = bad[2][:1] + bytes([bad[2][1] ^ 1]) + bad[2][2:]
        a.local.put_encoded(m, bad)  # a flipped bit on this machine's disk
        assert_same(a.get("c1"), art)
        a.flush()
        assert a.local.verify("c1").ok


def test_ttl_pin_and_budget_act_on_the_shared_copy(tier_uri: str, tmp_path: Path) -> None:
    with worker(tmp_path, "a", tier_uri) as a, worker(tmp_path, "b", tier_uri, confirm_ttl_s=0) as b:
        a.put("c1", make_artifact(6), ContextMeta(ttl_s=3600))
        assert b.get("c1") is not None
        assert a.update_meta("c1", pinned=True).pinned and b.shared.manifest("c1").pinned
        assert a.evict_to_budget(1) == []  # pinned
        a.update_meta("c1", pinned=False)
        assert a.evict_to_budget(1) == ["c1"]
        assert b.get("c1") is None  # gone from the copy of record: b's local copy is not served


@pytest.mark.s3
def test_object_store_stopped_local_copies_serve_cold_loads_are_unavailable_then_recover(s3_server, tmp_path: Path) -> None:
    uri = s3_server.uri()
    art1, art2 = make_artifact(7), make_artifact(8)
    with worker(tmp_path, "a", uri) as a, worker(tmp_path, "b", uri, retry_after_s=0.5) as b:
        a.put("hot", art1)
        a.put("cold", art2)
        assert b.get("hot") is not None
        s3_server.stop()
        t0 = time.monotonic()
        assert_same(b.get("hot"), art1)  # the local copy serves
        assert time.monotonic() - t0 < 1.5
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable, match="object store s3://"):
            b.get("cold")
        assert time.monotonic() - t0 < 4.5  # within the tier's deadline
        assert b.load_stats().unavailable == 1
        s3_server.start()
        time.sleep(0.6)  # past retry_after_s
        assert_same(b.get("cold"), art2)
        assert_same(b.get("hot"), art1)


@pytest.mark.s3
def test_a_hung_object_store_costs_a_local_hit_at_most_its_check_timeout(s3_server, tmp_path: Path) -> None:
    uri = s3_server.uri()
    with worker(tmp_path, "a", uri) as a, worker(tmp_path, "b", uri, hit_check_timeout_s=0.3) as b:
        a.put("hot", make_artifact(9))
        a.put("cold", make_artifact(10))
        assert b.get("hot") is not None
        s3_server.pause()
        try:
            t0 = time.monotonic()
            assert b.get("hot") is not None
            assert time.monotonic() - t0 < 1.0
            t0 = time.monotonic()
            with pytest.raises(StoreUnavailable):
                b.get("cold")
            assert time.monotonic() - t0 < 5.0  # the tier's 4 s deadline, not a hang
        finally:
            s3_server.resume()
        time.sleep(0.6)  # past the breaker's open_s (tiers/guard.py)
        assert_same(b.get("cold"), make_artifact(10))  # answered again once it runs


def test_a_put_whose_upload_fails_keeps_no_local_copy(tier_uri: str, tmp_path: Path) -> None:
    """The local copy is written while the object store takes the upload; if the upload fails
    the copy of record has nothing, so the local copy goes too."""
    with worker(tmp_path, "a", tier_uri) as a:
        def refuse(*args, **kw):  # noqa: ANN002, ANN003
            time.sleep(0.2)  # the local write runs meanwhile
            raise StoreUnavailable("object store unavailable")
        a.shared.tier.inner.put = refuse  # type: ignore[method-assign]
        with pytest.raises(StoreUnavailable):
            a.put("c1", make_artifact(12))
        time.sleep(1.0)  # past the breaker's open_s (tiers/guard.py) and the writer's cleanup, its probe
        assert a.local.manifest("c1") is None and a.get("c1") is None
        assert a.shared.tier.list(lay.CHUNKS) == []  # the failed write's chunks removed
