"""ObjectArtifactStore: context artifacts on a shared object tier, the copy of record.

Same methods as ArtifactStore (put, get, manifest, delete, update_meta, list_manifests,
context_ids, verify, stats, evict_expired, evict_to_budget, close, location), plus `fetch`
(verified stored bytes, for a local cache to keep without re-encoding) and `gc`.

Writes: every chunk first, each as soon as it is encoded (object_writer.py: a build hands its
layers over as it finishes them), the manifest last (object_layout.py), so a manifest that can
be read names chunks that were all stored before it; a writer that fails before its manifest
removes its chunks, and one that dies leaves only orphan chunks, which `gc` removes after a
grace period. Reads: the manifest (its own
sha256), then the chunks, each checked against the manifest's size and checksum before use:
damage or truncation is CorruptArtifact (DATA_LOSS), an unreachable store StoreUnavailable.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np

from ctxcache.artifact import READABLE_FORMATS, ContextArtifact
from ctxcache.store.object import object_layout as lay
from ctxcache.store.chunk_io import ChunkDecoder, Payload, check_chunk, check_size, decode_chunks
from ctxcache.store.config import BadChunk, StoreConfig, StoreStats, VerifyReport
from ctxcache.store.errors import CorruptArtifact, FormatMismatch
from ctxcache.store.keys import check_id
from ctxcache.store.layout import QUERY_CHUNK
from ctxcache.store.manifest import READABLE_STORE_FORMATS, ChunkInfo, ContextMeta, Manifest, UnsupportedFormat
from ctxcache.store.object.object_config import ObjectStoreConfig
from ctxcache.store.object.object_gc import GcReport, collect_garbage, make_room, summaries, victims_to_budget
from ctxcache.store.object.object_writer import ObjectWriter
from ctxcache.store.tiers import ObjectTier, open_tier
from ctxcache.store.tiers.guard import GuardedTier
from ctxcache.store.lmdb import txn_ops


class ChunkSink(Protocol):
    """What takes a fetch's chunks as they arrive (a ChunkDecoder, or a subset of one)."""

    def target(self, i: int) -> memoryview | None: ...

    def put(self, i: int, buf: Payload) -> None: ...


# given a fetch's manifest and chunks -> what takes each chunk as it arrives (ObjectArtifactStore.fetch)
Sink = Callable[[Manifest, tuple[ChunkInfo, ...]], ChunkSink]


class SubsetSink:
    """A decoder of some of a fetch's chunks (`wanted`, fetch indices in order); the others are
    fetched (a local copy is whole) and not decoded."""

    def __init__(self, decoder: ChunkDecoder, wanted: Sequence[int]) -> None:
        self.decoder, self._at = decoder, {i: j for j, i in enumerate(wanted)}

    def target(self, i: int) -> memoryview | None:
        return self.decoder.target(self._at[i]) if i in self._at else None

    def put(self, i: int, buf: Payload) -> None:
        if i in self._at:
            self.decoder.put(self._at[i], buf)

    def position(self, i: int) -> int | None:
        """Fetch index i's place among the decoded chunks (None: not decoded)."""
        return self._at.get(i)


def _read_buffer(use: ChunkSink | None, i: int, info: ChunkInfo) -> memoryview:
    """Where chunk i is read to: its tensor where the sink can take it in place, else fresh
    memory (np.empty: not zeroed, so nothing but the read touches it)."""
    got = use.target(i) if use is not None else None
    return got if got is not None else memoryview(np.empty(info.stored_bytes, np.uint8))


@dataclass(frozen=True)
class Fetched:
    """One artifact's manifest and its chunks' stored bytes, every one checked."""

    manifest: Manifest
    chunks: tuple[ChunkInfo, ...]  # the manifest's chunks that were fetched, in order
    payloads: tuple[Payload, ...]

    @property
    def nbytes(self) -> int:
        return sum(len(p) for p in self.payloads)


class ObjectArtifactStore:
    def __init__(self, tier: ObjectTier | str, config: ObjectStoreConfig = ObjectStoreConfig(),
                 codec: StoreConfig = StoreConfig(), clock: Callable[[], float] = time.time) -> None:
        """tier: an ObjectTier or its URI; codec: how put() encodes chunks (StoreConfig's codec
        fields and threads); clock: TTL and access times (tests pass a fake one)."""
        # every call behind a deadline and a circuit breaker (tiers/guard.py: a hung store fails fast)
        self.tier = GuardedTier(open_tier(tier, config.tier) if isinstance(tier, str) else tier, config.guard)
        self.config, self.codec, self._clock = config, codec, clock
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(codec.threads, "ctxobj")
        self._put_pool = ThreadPoolExecutor(config.put_threads, "ctxput")  # writers' encodes and uploads
        self._touched: dict[str, float] = {}

    @property
    def location(self) -> str:
        """What the registry records for artifacts here: the tier's URI."""
        return self.tier.uri

    def artifact_uri(self, context_id: str) -> str:
        """Where the artifact's manifest lives (credentials never appear in it)."""
        root = self.tier.uri.split("?", 1)[0].rstrip("/")
        return f"{root}/{lay.manifest_key(context_id)}"

    def _live(self) -> ThreadPoolExecutor:
        if self._pool is None:
            from ctxcache.store.errors import StoreClosed
            raise StoreClosed(f"object store {self.tier.uri} is closed")
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._put_pool.shutdown(wait=True)
            self.tier.close()
        self._pool = None

    def __enter__(self) -> "ObjectArtifactStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- write -----------------------------------------------------------------------------------
    def put(self, context_id: str, artifact: ContextArtifact, meta: ContextMeta = ContextMeta()) -> Manifest:
        return self.writer(context_id, meta).finish(artifact)

    def writer(self, context_id: str, meta: ContextMeta = ContextMeta(), codec: StoreConfig | None = None
               ) -> ObjectWriter:
        """A write whose layers are uploaded as they are handed over (object_writer.py); codec:
        how chunks are encoded (default: this store's)."""
        self._live()
        return ObjectWriter(self, context_id, meta, codec or self.codec, self._put_pool,
                            self.config.put_inflight_bytes, self._clock)

    def make_way(self, m: Manifest) -> Manifest | None:
        """Before a write's manifest: room in the budget for it (StoreFull if there is none) ->
        the manifest it replaces, if any."""
        if self.config.budget_bytes is not None:
            make_room(self, m.context_id, m.stored_bytes)
        return self._read_manifest(m.context_id, allow_expired=True, quiet=True)

    def publish(self, m: Manifest, old: Manifest | None) -> None:
        """The manifest of a write whose chunks are all stored: the context is visible from
        here. The write it replaces is deleted after (a reader of it retries: fetch)."""
        self.tier.put(lay.manifest_key(m.context_id), m.to_bytes())
        self._touched.pop(m.context_id, None)
        self.touch(m.context_id)
        if old is not None and lay.write_id(old) != lay.write_id(m):
            self.tier.delete_prefix(lay.folder_of(old))

    def touch(self, context_id: str) -> None:
        """Record a use for the shared tier's LRU (its access mark holds the time, 8 bytes), at
        most once per access_granularity_s per process."""
        now = self._clock()
        if now - self._touched.get(context_id, float("-inf")) < self.config.access_granularity_s:
            return
        self.tier.put(lay.access_key(context_id), struct.pack("<d", now))
        self._touched[context_id] = now

    def delete(self, context_id: str) -> bool:
        """Manifest first (the artifact is gone for readers at once), then its write's chunks.
        A context with an unreadable manifest loses every write; a write that no manifest names
        yet (a concurrent put's) is left to gc."""
        self._live()
        try:
            old = self._read_manifest(context_id, allow_expired=True)
        except (CorruptArtifact, FormatMismatch):
            old = None
            folders = [f.key for f in self.tier.folders(lay.CHUNKS)
                       if lay.context_of_folder(f.key) == context_id]
        else:
            folders = [lay.folder_of(old)] if old is not None else []
        found = self.tier.delete(lay.manifest_key(context_id))
        for folder in folders:
            self.tier.delete_prefix(folder)
        self.tier.delete(lay.access_key(context_id))
        self._touched.pop(context_id, None)
        return found

    def update_meta(self, context_id: str, *, pinned: bool | None = None,
                    ttl_s: float | None | type[...] = ..., labels: Mapping[str, str] | None = None
                    ) -> Manifest | None:
        """Change pin / TTL (counted from now; None = no expiry) / labels: the manifest is
        rewritten in one atomic put (the chunks, and so the write id, stay)."""
        self._live()
        changes: dict[str, Any] = {} if pinned is None else {"pinned": bool(pinned)}
        if labels is not None:
            changes["labels"] = dict(ContextMeta(labels=dict(labels)).labels)
        m = self._read_manifest(context_id)
        if m is None:
            return None
        if ttl_s is not ...:
            ContextMeta(ttl_s=ttl_s)  # validates
            changes["ttl_s"] = None if ttl_s is None else self._clock() - m.created_at + ttl_s
        new = replace(m, **changes)
        self.tier.put(lay.manifest_key(context_id), new.to_bytes())
        return new

    def evict_expired(self) -> list[str]:
        gone = [s.context_id for s in summaries(self) if s.expired and not s.pinned]
        return [cid for cid in gone if self.delete(cid)]

    def evict_to_budget(self, budget_bytes: int | None = None) -> list[str]:
        """Evict expired, then LRU unpinned contexts until stored bytes <= budget (default:
        config.budget_bytes; None there means no budget: only expired ones go)."""
        budget = self.config.budget_bytes if budget_bytes is None else budget_bytes
        return [cid for cid in victims_to_budget(summaries(self), budget) if self.delete(cid)]

    def gc(self, grace_s: float | None = None) -> GcReport:
        """Delete expired contexts, then objects nothing references (orphan chunks of a dead or
        superseded writer, access marks of deleted contexts, partial writes) older than grace_s."""
        return collect_garbage(self, self.config.gc_grace_s if grace_s is None else grace_s)

    # ---- read ------------------------------------------------------------------------------------
    def _read_manifest(self, context_id: str, allow_expired: bool = False, quiet: bool = False
                       ) -> Manifest | None:
        raw = self.tier.get(lay.manifest_key(check_id(context_id)))
        if raw is None:
            return None
        try:
            m = parse_manifest(context_id, raw)
        except (CorruptArtifact, FormatMismatch):
            if quiet:
                return None
            raise
        return m if allow_expired or not m.expired(self._clock()) else None

    def manifest(self, context_id: str) -> Manifest | None:
        """None if absent or expired; CorruptArtifact / FormatMismatch for a bad one."""
        self._live()
        return self._read_manifest(context_id)

    def fetch(self, context_id: str, with_queries: bool = True, sink: Sink | None = None,
              first: Manifest | None = None) -> Fetched | None:
        """The manifest and its chunks' stored bytes, every chunk checked (config.verify_on_load)
        as it arrives. A write replaced or deleted mid-fetch is read again once / None. sink:
        sink(manifest, chunks) -> what takes each checked chunk on the thread that read it,
        while the others are still arriving (a load decodes there), and may give the memory a
        chunk is read into (its tensor: no copy). first: the manifest, read already."""
        self._live()
        how = self.config.verify_on_load
        for attempt in range(2):
            m = first if attempt == 0 and first is not None else self._read_manifest(context_id)
            if m is None:
                return None
            chunks = tuple(c for c in m.chunks if with_queries or c.name != QUERY_CHUNK)
            wid = lay.write_id(m)
            use = sink(m, chunks) if sink is not None else None
            outs = [_read_buffer(use, i, c) for i, c in enumerate(chunks)]

            def arrived(i: int, size: int | None, m: Manifest = m, chunks: tuple[ChunkInfo, ...] = chunks,
                        use: ChunkSink | None = use, outs: list[memoryview] = outs) -> None:
                if size is None:
                    return  # absent: replaced or deleted mid-fetch (looked at below)
                check_size(m, chunks[i], size)
                check_chunk(m, chunks[i], outs[i], how)
                if use is not None:
                    use.put(i, outs[i])

            sizes = self.tier.get_many_into([lay.chunk_key(m.context_id, wid, c) for c in chunks], outs, arrived)
            if any(n is None for n in sizes) and attempt == 0:
                now = self._read_manifest(context_id, allow_expired=True, quiet=True)
                if now is None:
                    return None  # deleted while we read it
                if lay.write_id(now) != wid:
                    continue  # replaced while we read it: read the new write
            for info, n in zip(chunks, sizes):
                if n is None:
                    check_chunk(m, info, None, how)  # raises: the chunk is missing
            return Fetched(m, chunks, tuple(outs))
        raise AssertionError("unreachable: the second attempt returns or raises")

    def decode(self, f: Fetched) -> ContextArtifact:
        """The artifact of fetched (already checked) chunks."""
        return decode_chunks(f.manifest, f.chunks, f.payloads, self._live(), "none",
                             self.codec.huge_pages, self.codec.pin_memory)

    def get(self, context_id: str, with_queries: bool = False) -> ContextArtifact | None:
        got = self.fetch_decoded(context_id, with_queries, with_queries)
        return None if got is None else got[1]

    def fetch_decoded(self, context_id: str, fetch_queries: bool = True, decode_queries: bool = False
                      ) -> tuple[Fetched, ContextArtifact] | None:
        """Fetch (the query chunks too with fetch_queries: a local copy is whole) and decode
        what a load reads, each chunk as it arrives: the decode overlaps the download instead
        of following it."""
        box: dict[str, ChunkDecoder] = {}

        def sink(m: Manifest, chunks: tuple[ChunkInfo, ...]) -> ChunkSink:
            wanted = [i for i, c in enumerate(chunks) if decode_queries or c.name != QUERY_CHUNK]
            dec = box["decoder"] = ChunkDecoder(m, [chunks[i] for i in wanted], self.codec.huge_pages,
                                                self.codec.pin_memory)
            return SubsetSink(dec, wanted)

        f = self.fetch(context_id, fetch_queries, sink)
        return None if f is None else (f, box["decoder"].artifact())

    def list_manifests(self, offset: int = 0, limit: int = 100, labels: Mapping[str, str] | None = None,
                       tenant: str | None = None, after: str | None = None) -> list[Manifest]:
        """Manifests in id order, skipping expired and unreadable ones (verify reports those)."""
        self._live()
        if offset < 0 or limit < 0:
            raise ValueError(f"offset={offset} and limit={limit} must be >= 0")
        want, out = dict(labels or {}), []
        ids = [cid for cid in self.context_ids() if after is None or cid > after]
        step = max(16, min(256, offset + limit))
        for i in range(0, len(ids), step):
            for m in self.read_manifests(ids[i:i + step]):
                if m is not None and not m.expired(self._clock()) and (tenant is None or m.tenant == tenant) \
                        and all(m.labels.get(k) == v for k, v in want.items()):
                    out.append(m)
            if len(out) >= offset + limit:
                break
        return out[offset:offset + limit]

    def read_manifests(self, ids: Sequence[str]) -> list[Manifest | None]:
        """Each id's manifest, expired ones included; None where absent or unreadable."""
        raws = self.tier.get_many([lay.manifest_key(cid) for cid in ids])
        out: list[Manifest | None] = []
        for cid, raw in zip(ids, raws):
            try:
                out.append(None if raw is None else parse_manifest(cid, raw))
            except (CorruptArtifact, FormatMismatch):
                out.append(None)
        return out

    def context_ids(self) -> list[str]:
        """Every context with a manifest object, unreadable or expired ones included."""
        self._live()
        parsed = (lay.parse_key(o.key) for o in self.tier.list(lay.MANIFESTS))
        return [p.context_id for p in parsed if p is not None and p.kind == "manifest"]

    def verify(self, context_id: str) -> VerifyReport:
        """Hash every stored chunk (sha256 and xxh3, zstd frames) against the manifest."""
        self._live()
        try:
            m = self._read_manifest(context_id, allow_expired=True)
        except (CorruptArtifact, FormatMismatch) as exc:
            return VerifyReport(context_id, True, 0, (BadChunk("manifest", str(exc)),))
        if m is None:
            return VerifyReport(context_id, False, 0)
        bufs = self.tier.get_many(lay.chunk_keys(m))
        bad = [BadChunk(c.label(), why) for c, b in zip(m.chunks, bufs)
               if (why := txn_ops.check_chunk(c, b))]
        return VerifyReport(context_id, True, len(m.chunks), tuple(bad))

    def stats(self) -> StoreStats:
        ids = self.context_ids()
        ms = [m for m in self.read_manifests(ids) if m is not None]
        return StoreStats(
            contexts=len(ms), pinned=sum(m.pinned for m in ms), corrupt_manifests=len(ids) - len(ms),
            stored_bytes=sum(m.stored_bytes for m in ms), raw_bytes=sum(m.raw_bytes() for m in ms),
            raw_kv_bytes=sum(m.raw_kv_bytes for m in ms), raw_table_bytes=sum(m.raw_table_bytes for m in ms),
            budget_bytes=self.config.budget_bytes or 0, map_size_bytes=0, map_used_bytes=0)


def parse_manifest(context_id: str, raw: bytes) -> Manifest:
    """Checked manifest bytes -> Manifest; CorruptArtifact / FormatMismatch say what is wrong."""
    try:
        m = Manifest.from_bytes(raw)
    except UnsupportedFormat as exc:
        raise FormatMismatch(context_id, "store_format", exc.found, READABLE_STORE_FORMATS) from None
    except (ValueError, TypeError, KeyError) as exc:
        raise CorruptArtifact(context_id, "manifest", f"unreadable manifest: {exc}") from None
    if m.context_id != context_id:
        raise CorruptArtifact(context_id, "manifest", f"manifest names context {m.context_id!r}")
    if m.format_version not in READABLE_FORMATS:
        raise FormatMismatch(context_id, "format_version", m.format_version, READABLE_FORMATS)
    return m
