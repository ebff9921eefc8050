"""A download from the object store handed over as it lands (TieredStore.get_landing): each
layer is readable once its chunks are read and checked, while later ones are still arriving; the
landed artifact is the stored one bit for bit; a damaged chunk in a late layer fails the landing
(CorruptArtifact) for every wait that has not been answered, and nothing of it stays."""

from __future__ import annotations

import collections
import threading
from pathlib import Path

import pytest

from ctxcache.landing import Landing, wait_landed
from ctxcache.store import CorruptArtifact
from ctxcache.store.object import object_layout as lay
from ctxcache.store.tiered_store import TieredStore, open_store
from landing_helpers import hold_layer
from store_helpers import assert_same, make_artifact
from test_tiered_store import FAST, SMALL

LAYERS = 4


# ---- the gate alone ----------------------------------------------------------------------------
def test_a_layer_is_ready_once_its_chunks_and_the_context_ones_have_landed() -> None:
    g = Landing([None, 0, 0, 1], n_layers=2)
    g.landed(1)
    g.landed(2)
    assert not g.ready(0)  # the context-wide chunk is not there yet
    g.landed(0)
    assert g.ready(0) and not g.ready(1) and not g.ready()
    with pytest.raises(TimeoutError):
        g.wait(1, timeout=0.01)
    g.landed(3)
    g.wait(1)
    assert not g.ready()  # the whole download has not ended yet
    g.finish()
    g.wait()


def test_a_failure_is_raised_by_every_wait_not_answered_and_told_once() -> None:
    g = Landing([None, 0, 1], n_layers=2)
    told: list[BaseException] = []
    g.on_fail(told.append)
    g.landed(0)
    g.landed(1)
    err = CorruptArtifact("c", "1.k", "xxh3 checksum mismatch")
    g.fail(err)
    g.fail(RuntimeError("second"))  # the first error stands
    g.wait(0)  # landed and checked before the failure: still answered
    for layer in (1, None):
        with pytest.raises(CorruptArtifact):
            g.wait(layer)
    late: list[BaseException] = []
    g.on_fail(late.append)  # after the failure: told at once
    assert told == late == [err] and g.failed is err


def test_layers_must_lie_within_the_artifact() -> None:
    with pytest.raises(ValueError, match="n_layers=2"):
        Landing([0, 2], n_layers=2)


# ---- through the tiered store ------------------------------------------------------------------
def worker(tmp_path: Path, name: str, uri: str) -> TieredStore:
    store = open_store(tmp_path / name, SMALL, uri, FAST)
    assert isinstance(store, TieredStore)
    return store


def test_a_download_is_handed_over_before_its_last_layer_arrives_and_lands_bit_exact(
        tmp_path: Path) -> None:
    uri = f"file://{tmp_path / 'shared'}"
    art = make_artifact(5, n=384, layers=LAYERS, d=32)
    with worker(tmp_path, "a", uri) as a, worker(tmp_path, "b", uri) as b:
        a.put("c1", art)
        release = hold_layer(b, LAYERS - 1)
        got = b.get_landing("c1")  # returns while the last layer is held back
        assert got is not None and got.landing is not None
        got.landing.wait(LAYERS - 2, timeout=10)  # the earlier layers land meanwhile
        assert not got.landing.ready(LAYERS - 1) and not got.landing.ready()
        assert b.local.manifest("c1") is None and b.load_stats().tiers["object"].hits == 0
        release.set()
        wait_landed(got)
        assert_same(got, art)
        b.flush()  # the local copy and the stats follow the download's end
        assert b.local.manifest("c1") is not None and b.load_stats().tiers["object"].hits == 1
        assert_same(b.get("c1"), art)


def test_a_damaged_chunk_in_the_last_layer_fails_the_landing_after_the_early_layers(tmp_path: Path) -> None:
    uri = f"file://{tmp_path / 'shared'}"
    art = make_artifact(6, n=384, layers=LAYERS, d=32)
    with worker(tmp_path, "a", uri) as a, worker(tmp_path, "b", uri) as b:
        m = a.put("c1", art)
        key = next(k for k in lay.chunk_keys(m) if k.endswith(f"/{LAYERS - 1}.v"))
        data = a.shared.tier.get(key)
        a.shared.tier.put(key, data[:9] + bytes([data[9] ^ 4]) + data[10:])
        # the damaged layer's reads wait until layer 0 is handed over: the download's chunks
        # land in any order, and a check failing first fails every wait not yet answered
        release = hold_layer(b, LAYERS - 1)
        got = b.get_landing("c1")
        assert got is not None
        told: list[BaseException] = []
        got.landing.on_fail(told.append)
        got.landing.wait(0, timeout=10)  # an intact early layer is handed over
        release.set()
        with pytest.raises(CorruptArtifact, match="checksum"):
            got.landing.wait(LAYERS - 1, timeout=10)
        assert isinstance(told[0], CorruptArtifact)
        b.flush()
        assert b.local.manifest("c1") is None  # nothing of a damaged download is kept
        assert b.load_stats().corrupt == 1
        with pytest.raises(CorruptArtifact):  # a plain get of it raises as before
            b.get("c1")


def test_a_caller_after_the_hand_over_shares_the_download_still_landing(tmp_path: Path) -> None:
    uri = f"file://{tmp_path / 'shared'}"
    art = make_artifact(7, n=256, layers=LAYERS, d=32)
    with worker(tmp_path, "a", uri) as a, worker(tmp_path, "b", uri) as b:
        a.put("c1", art)
        release = hold_layer(b, LAYERS - 1)
        first = b.get_landing("c1")
        plain: list = []
        t = threading.Thread(target=lambda: plain.append(b.get("c1")))  # waits for the landing
        t.start()
        assert b.get_landing("c1") is first  # no second download
        assert t.is_alive() and not first.landing.ready()
        release.set()
        t.join(10)
        assert plain[0] is first and b.load_stats().shared_downloads == 2
        assert_same(first, art)
        b.flush()
        assert b.load_stats().tiers["object"].hits == 1
        assert b.get_landing("c1").landing is None  # landed: now from the local copy


# ---- the download's requests -------------------------------------------------------------------
class CountingFs:
    """A pyarrow filesystem that counts the calls that stat an object (S3: a HEAD each)."""

    STATS = ("open_input_file", "open_input_stream", "get_file_info")

    def __init__(self, fs: object) -> None:
        self.fs, self.stats = fs, collections.Counter()

    def __getattr__(self, name: str) -> object:
        attr = getattr(self.fs, name)
        if name not in self.STATS:
            return attr

        def counted(path: object, *args: object, **kwargs: object) -> object:
            self.stats[str(path)] += 1
            return attr(path, *args, **kwargs)
        return counted


def test_a_landing_download_stats_each_chunk_once_not_each_range_and_lands_bit_exact(
        tier_uri: str, monkeypatch) -> None:
    """A chunk is read as ranges; only its open asks the store for its size (S3: a HEAD), once
    per chunk: every range after it is one ranged read on that handle."""
    from ctxcache.store.object.object_landing import fetch_landing
    from ctxcache.store.object.object_store import ObjectArtifactStore
    from ctxcache.store.tiers import arrow

    art = make_artifact(7, n=384, layers=LAYERS, d=32)
    with ObjectArtifactStore(tier_uri) as s:
        m = s.put("c1", art)
        monkeypatch.setattr(arrow, "RANGE_BYTES", 4096)
        ranges = sum(-(-c.stored_bytes // 4096) for c in m.chunks)
        assert ranges >= 2 * len(m.chunks)  # most chunks are several ranges
        fs = CountingFs(s.tier.inner.fs)
        s.tier.inner.fs = fs
        got = fetch_landing(s, "c1", lambda fn, *a: threading.Thread(target=fn, args=a).start())
        assert got is not None
        landed, start = got
        start()
        wait_landed(landed)
        assert_same(landed, art)
        chunk_paths = {s.tier.inner.path(k) for k in lay.chunk_keys(m)}
        stats = {p: n for p, n in fs.stats.items() if p != s.tier.inner.path(lay.manifest_key("c1"))}
        assert set(stats) == chunk_paths and set(stats.values()) == {1}, f"stats of a chunk: up to {max(stats.values())}"
