"""TieredStore: the shared object store as the copy of record, this machine's LMDB in front.

    object store (shared) -> local LMDB (SSD) -> DRAM (service ArtifactCache) -> HBM (GPU runner)

It has ArtifactStore's methods, so the service uses it unchanged. Writes go to the object store
(chunks, then the manifest), then to the local cache. A get is answered by the local cache when
it holds the context (after a quick check that the object store still has it: a Delete on
another worker must not be served here), else downloaded once, checked and decoded, and kept
locally in the background; concurrent gets of one context share that download. The local cache
evicts by its own budget (ArtifactStore's LRU); TTL, pin, Delete and the shared budget act on
the object store. The read path's helpers live in read_through.py.

When the object store does not answer, contexts in the local cache keep serving (the check
gives up after `hit_check_timeout_s` and is skipped for `retry_after_s`), and anything that
needs the object store raises StoreUnavailable within the tier's deadline.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from ctxcache.artifact import ContextArtifact, LayerArtifact
from ctxcache.landing import wait_landed
from ctxcache.store.lmdb.artifact_store import ArtifactStore
from ctxcache.store.artifact_writer import landed
from ctxcache.store.config import StoreConfig, StoreStats, VerifyReport
from ctxcache.store.errors import CorruptArtifact, StoreError, StoreUnavailable
from ctxcache.store.layout import QUERY_CHUNK
from ctxcache.store.load_stats import LoadSnapshot, LoadStats
from ctxcache.store.manifest import ContextMeta, Manifest
from ctxcache.store.object.object_config import ObjectStoreConfig
from ctxcache.store.object.object_landing import fetch_landing
from ctxcache.store.object.object_store import Fetched, ObjectArtifactStore
from ctxcache.store.object.object_writer import ObjectWriter
from ctxcache.store.read_through import Presence, SingleFlight, TieredConfig

__all__ = ["TieredConfig", "TieredStore", "open_store"]

log = logging.getLogger("ctxcache.store.tiered")
LANDING_THREADS = 8  # downloads landing at once (each reads its chunks on the tier's own pool)


class TieredStore:
    def __init__(self, local: ArtifactStore, shared: ObjectArtifactStore,
                 config: TieredConfig = TieredConfig(), clock: Callable[[], float] = time.monotonic) -> None:
        self.local, self.shared, self.tiered_config = local, shared, config
        self.loads = LoadStats()
        self._flights: SingleFlight[tuple[str, bool]] = SingleFlight()
        self._presence = Presence(shared.tier, config, clock)
        self._lock = threading.Lock()
        # local copies of downloads are written after the load returns (LMDB + fsync took longer
        # than the download from a local folder: bench tiers); until then a load decodes
        # from the downloaded bytes held here
        self._filler = ThreadPoolExecutor(1, "ctxfill")
        self._lander = ThreadPoolExecutor(LANDING_THREADS, "ctxland")  # landing downloads (get_landing)
        self._filling: dict[str, Fetched] = {}
        self._landing: dict[str, ContextArtifact] = {}  # downloads handed over, still landing

    # ---- what the service reads --------------------------------------------------------------------
    @property
    def config(self) -> StoreConfig:
        return self.local.config

    @config.setter
    def config(self, value: StoreConfig) -> None:  # Backend.relocate sets the location here
        self.local.config = value

    @property
    def location(self) -> str:
        """This worker's location (as ArtifactStore's); the artifacts' is `uri`."""
        return self.local.location

    @property
    def uri(self) -> str:
        return self.shared.location

    def artifact_uri(self, context_id: str) -> str:
        return self.shared.artifact_uri(context_id)

    def load_stats(self) -> LoadSnapshot:
        return self.loads.snapshot()

    # ---- write -------------------------------------------------------------------------------------
    def put(self, context_id: str, artifact: ContextArtifact, meta: ContextMeta = ContextMeta()) -> Manifest:
        return self.writer(context_id, meta).finish(artifact)

    def writer(self, context_id: str, meta: ContextMeta = ContextMeta()) -> "TieredWriter":
        """Encode once and upload (the object store holds the copy of record), each layer as it
        is handed over: done when the manifest is up. The local cache's copy is written after,
        on the filler thread, and a load until then decodes from the encoded bytes held for it,
        as after a download (an H200's 32K PutContext spent 3.8 s in the LMDB write against
        3.2 s uploading beside it)."""
        return TieredWriter(self, self.shared.writer(context_id, meta, self.local.config))

    def _keep_local(self, m: Manifest, payloads) -> None:  # noqa: ANN001 (Sequence[Payload])
        try:
            self.local.put_encoded(m, payloads)
        except StoreError as exc:  # e.g. StoreFull: the object store has it; serve it uncached
            log.warning("context %s not kept in the local cache: %s", m.context_id[:12], exc)

    def delete(self, context_id: str) -> bool:
        """From the object store and the local cache (the local copy goes even if the object
        store does not answer; then StoreUnavailable is raised)."""
        local = self.drop_local(context_id)
        return self.shared.delete(context_id) or local

    def drop_local(self, context_id: str) -> bool:
        """Forget this worker's copy (e.g. told by the registry that it was deleted elsewhere):
        the local LMDB's, a download not yet written there, and the last word of the object store."""
        with self._lock:
            self._filling.pop(context_id, None)
            self._landing.pop(context_id, None)
        self._presence.forget(context_id)
        return self.local.delete(context_id)

    def update_meta(self, context_id: str, *, pinned: bool | None = None,
                    ttl_s: float | None | type[...] = ..., labels: Mapping[str, str] | None = None
                    ) -> Manifest | None:
        new = self.shared.update_meta(context_id, pinned=pinned, ttl_s=ttl_s, labels=labels)
        if new is not None and self.local.manifest(context_id) is not None:
            self._keep_local_meta(new)
        return new

    def _keep_local_meta(self, new: Manifest) -> None:
        self.local.update_meta(new.context_id, pinned=new.pinned, labels=new.labels)
        if new.ttl_s is None:
            self.local.update_meta(new.context_id, ttl_s=None)
        else:  # the same expiry time: ArtifactStore counts a new TTL from now
            left = new.created_at + new.ttl_s - time.time()
            if left > 0:
                self.local.update_meta(new.context_id, ttl_s=left)
            else:
                self.local.delete(new.context_id)

    def evict_expired(self) -> list[str]:
        gone = self.shared.evict_expired()
        return sorted(set(gone) | set(self.local.evict_expired()))

    def evict_to_budget(self, budget_bytes: int | None = None) -> list[str]:
        """The shared tier's budget (the local cache keeps its own on every put)."""
        gone = self.shared.evict_to_budget(budget_bytes)
        for cid in gone:
            self.local.delete(cid)
        return gone

    def gc(self, grace_s: float | None = None):  # noqa: ANN201 (object_gc.GcReport)
        return self.shared.gc(grace_s)

    # ---- read --------------------------------------------------------------------------------------
    def get(self, context_id: str, with_queries: bool = False) -> ContextArtifact | None:
        """The artifact, or None if absent / expired / deleted. CorruptArtifact (DATA_LOSS) if
        an object fails its check; StoreUnavailable if only the object store could answer."""
        art = self._get(context_id, with_queries)
        wait_landed(art)  # a download another caller started landing
        return art

    def get_landing(self, context_id: str) -> ContextArtifact | None:
        """As get(context_id), but a download from the object store is handed over once its
        manifest is read, its `landing` set (ctxcache/landing.py): a slot load copies each
        layer as it lands. The download's errors (CorruptArtifact, StoreUnavailable) are raised
        by the landing's waits; its bookkeeping (the local copy, the stats) follows its end."""
        return self._get(context_id, False)

    def _get(self, context_id: str, with_queries: bool) -> ContextArtifact | None:
        t0 = time.perf_counter()
        try:
            art = self.local.get(context_id, with_queries)
        except CorruptArtifact as exc:  # a damaged cache copy: the copy of record replaces it
            log.warning("local copy refused (%s); reloading from the object store", exc)
            self.local.delete(context_id)
            art = None
        if art is not None:
            if self._presence.still_there(context_id):
                m = self.local.manifest(context_id)
                self.loads.hit("local", m.stored_bytes if m else 0, time.perf_counter() - t0)
                self._mark_use(context_id)
                return art
            self.local.delete(context_id)  # deleted on the copy of record: not served here
            self.loads.count("misses")
            return None
        return self._shared_get(context_id, with_queries)

    def _shared_get(self, context_id: str, with_queries: bool) -> ContextArtifact | None:
        # without queries every download lands (a plain get waits for it): one download of a
        # context, landing or not, whichever way its callers ask
        download = self._download if with_queries else self._download_landing
        art, joined = self._flights.run((context_id, with_queries), lambda: download(context_id, with_queries))
        if joined:
            self.loads.count("shared_downloads")
        return art

    def _download(self, context_id: str, with_queries: bool) -> ContextArtifact | None:
        t0 = time.perf_counter()
        with self._lock:
            f = self._filling.get(context_id)
        if f is not None:  # a put's or a download's bytes, not yet in the local copy
            art = self.shared.decode(f if with_queries else _without_queries(f))
        else:
            got = self._fetch(context_id, with_queries)
            if got is None:
                return None
            f, art = got
            self._fill_later(f)  # after the decode, which the LMDB write would slow
        self._presence.confirm(context_id)
        self.loads.hit("object", f.nbytes, time.perf_counter() - t0)
        self._mark_use(context_id)
        return art

    def _download_landing(self, context_id: str, with_queries: bool) -> ContextArtifact | None:
        """_download's artifact handed over as it lands (object_landing.py); the bytes of a
        put or download not yet in the local copy decode at once, as there."""
        with self._lock:
            filling = context_id in self._filling
            art = self._landing.get(context_id)
        if filling:
            return self._download(context_id, with_queries)
        if art is not None:  # still landing: a caller after its hand-over shares it too
            self.loads.count("shared_downloads")
            return art
        t0, mine = time.perf_counter(), []  # mine: the artifact, known before its download starts
        try:
            got = fetch_landing(self.shared, context_id, self._lander.submit,
                                lambda result: self._landed(context_id, mine[0], result, t0))
        except BaseException as exc:
            self._count_failure(exc)
            raise
        if got is None:
            self.loads.count("misses")
            return None
        art, start = got
        mine.append(art)
        with self._lock:
            self._landing[context_id] = art
        try:
            start()
        except BaseException as exc:  # e.g. the store closed meanwhile: its waiters must not hang
            with self._lock:
                self._landing.pop(context_id, None)
            art.landing.fail(exc)
            raise
        return art

    def _landed(self, context_id: str, art: ContextArtifact, got: Fetched | BaseException, t0: float) -> None:
        """A landing download's end (on its thread): what _download does after its fetch."""
        with self._lock:
            if self._landing.get(context_id) is art:
                del self._landing[context_id]
        if isinstance(got, BaseException):
            self._count_failure(got)
            return
        self._fill_later(got)
        self._presence.confirm(context_id)
        self.loads.hit("object", got.nbytes, time.perf_counter() - t0)
        self._mark_use(context_id)

    def _count_failure(self, exc: BaseException) -> None:
        if isinstance(exc, StoreUnavailable):
            self.loads.count("unavailable")
            self._presence.mark_down()
        elif isinstance(exc, CorruptArtifact):
            self.loads.count("corrupt")

    def _fetch(self, context_id: str, with_queries: bool) -> tuple[Fetched, ContextArtifact] | None:
        try:  # all chunks: the local copy is whole; decoded as they arrive
            got = self.shared.fetch_decoded(context_id, fetch_queries=True, decode_queries=with_queries)
        except StoreUnavailable:
            self.loads.count("unavailable")
            self._presence.mark_down()
            raise
        except CorruptArtifact:
            self.loads.count("corrupt")
            raise
        if got is None:
            self.loads.count("misses")
        return got

    def _fill_later(self, f: Fetched) -> None:
        with self._lock:
            self._filling[f.manifest.context_id] = f
        self._filler.submit(self._fill, f)

    def _fill(self, f: Fetched) -> None:
        cid = f.manifest.context_id
        try:
            self._keep_local(f.manifest, f.payloads)
        except Exception:  # noqa: BLE001 - a background thread must not die on one bad write
            log.exception("local copy of %s failed", cid[:12])
        with self._lock:
            deleted = cid not in self._filling  # delete() ran meanwhile
            if self._filling.get(cid) is f:  # (a newer put of the same id fills after this one)
                del self._filling[cid]
        if deleted:
            self.local.delete(cid)

    def flush(self) -> None:
        """Wait until every downloaded artifact is in the local cache."""
        self._filler.submit(lambda: None).result()

    def _mark_use(self, context_id: str) -> None:
        if not self._presence.down:
            self._presence.side.submit(self._touch_quietly, context_id)

    def _touch_quietly(self, context_id: str) -> None:
        try:
            self.shared.touch(context_id)
        except StoreError as exc:  # the mark is an LRU hint: a miss costs nothing else
            log.debug("access mark of %s skipped: %s", context_id[:12], exc)

    def manifest(self, context_id: str) -> Manifest | None:
        """The local copy's manifest while the object store has the context, else the object
        store's (no download)."""
        m = self.local.manifest(context_id)
        if m is None:
            return self.shared.manifest(context_id)
        if self._presence.still_there(context_id):
            return m
        self.local.delete(context_id)  # deleted on the copy of record
        return None

    def list_manifests(self, offset: int = 0, limit: int = 100, labels: Mapping[str, str] | None = None,
                       tenant: str | None = None, after: str | None = None) -> list[Manifest]:
        return self.shared.list_manifests(offset, limit, labels, tenant, after)

    def context_ids(self) -> list[str]:
        return self.shared.context_ids()

    def verify(self, context_id: str) -> VerifyReport:
        """The copy of record's objects (a damaged local copy is refused at load anyway)."""
        return self.shared.verify(context_id)

    def stats(self) -> StoreStats:
        """The object store's contexts and budget, this machine's LMDB map."""
        local = self.local.stats()
        return replace(self.shared.stats(), map_size_bytes=local.map_size_bytes,
                       map_used_bytes=local.map_used_bytes)

    def close(self) -> None:
        self._lander.shutdown(wait=True)
        self._filler.shutdown(wait=True)
        self._presence.close()
        self.shared.close()
        self.local.close()

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TieredWriter:
    """An ObjectWriter whose finished write is then kept in the local cache (a failed upload
    leaves no local copy behind)."""

    def __init__(self, store: TieredStore, inner: ObjectWriter) -> None:
        self.store, self.inner = store, inner

    def add_layer(self, index: int, layer: LayerArtifact, kv_codec: str,
                  ready: Callable[[], None] = landed) -> None:
        self.inner.add_layer(index, layer, kv_codec, ready)

    def finish(self, artifact: ContextArtifact) -> Manifest:
        m, payloads = self.inner.finish_encoded(artifact)
        self.store._fill_later(Fetched(m, tuple(m.chunks), tuple(payloads)))
        return m

    def abort(self) -> None:
        self.inner.abort()


def _without_queries(f: Fetched) -> Fetched:
    keep = [i for i, c in enumerate(f.chunks) if c.name != QUERY_CHUNK]
    return Fetched(f.manifest, tuple(f.chunks[i] for i in keep), tuple(f.payloads[i] for i in keep))


def open_store(path: str | Path, config: StoreConfig = StoreConfig(), object_uri: str | None = None,
               object_config: ObjectStoreConfig = ObjectStoreConfig(),
               tiered: TieredConfig = TieredConfig()) -> ArtifactStore | TieredStore:
    """The service's store: LMDB at path alone (object_uri None: today's single node), or LMDB
    as the local cache of the object store at object_uri (s3://... or file:///...)."""
    local = ArtifactStore(path, config)
    if object_uri is None:
        return local
    try:
        shared = ObjectArtifactStore(object_uri, object_config, config)
    except BaseException:
        local.close()
        raise
    return TieredStore(local, shared, tiered)
