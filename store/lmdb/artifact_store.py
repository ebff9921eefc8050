"""ArtifactStore: context artifacts in LMDB, a manifest and its chunks.

A put is one transaction (chunks, access time, manifest); a build's put (`writer`) commits
each layer's chunks as it is handed over and the manifest last (stream_writer.py): chunk keys
without a manifest are invisible, and those a killed process left are swept at open.

LMDB rules followed here (shared/FINDINGS.md): open the environment in the process that uses
it (after fork; a store used from another pid raises StoreClosed); `reader_check()` at open
clears reader slots of dead processes; a context's chunks are read and copied out in one
short read transaction, never held across a stream; MapFullError is answered by evicting
unpinned LRU contexts and retrying, then StoreFull, never by resizing the map.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
from dataclasses import replace
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import lmdb
import torch

from ctxcache.artifact import READABLE_FORMATS, ContextArtifact
from ctxcache.store import eviction
from ctxcache.store.artifact_writer import ArtifactWriter, DeferredWriter
from ctxcache.store.chunk_io import ChunkStream, Payload, decode_chunks, encode_artifact, raw_bytes
from ctxcache.store.config import StoreConfig, StoreStats, VerifyReport
from ctxcache.store.errors import CorruptArtifact, FormatMismatch, StoreClosed, StoreError, StoreFull
from ctxcache.store.keys import AccessKey, ChunkKey, ManifestKey, check_id, prefix
from ctxcache.store.lmdb.lmdb_file import StoreDamaged, check_data_file, still_whole
from ctxcache.store.layout import QUERY_CHUNK, Slot, chunk_tensors
from ctxcache.store.manifest import READABLE_STORE_FORMATS, ContextMeta, Manifest
from ctxcache.store.lmdb.stream_writer import StreamWriter
from ctxcache.store.lmdb.txn_ops import (ManifestRead, delete_context, orphan_ids, read_manifest,
                                         scan_manifests, verify_chunks)

log = logging.getLogger("ctxcache.store.lmdb")


class ArtifactStore:
    def __init__(self, path: str | Path, config: StoreConfig = StoreConfig(),
                 clock: Callable[[], float] = time.time) -> None:
        self.path, self.config, self._clock = Path(path), config, clock
        if not config.readonly:
            self.path.mkdir(parents=True, exist_ok=True)
        self._size_seen = check_data_file(self.path)  # a truncated data.mdb would SIGBUS
        if config.pin_memory and not torch.cuda.is_available():
            raise ValueError("pin_memory=True needs CUDA (page-locked memory is CUDA's host allocator)")
        self._env = lmdb.open(str(self.path), map_size=config.map_size_bytes, subdir=True,
                              max_readers=config.max_readers, readonly=config.readonly,
                              sync=config.sync, metasync=config.sync, lock=True, max_dbs=0)
        self.stale_readers_cleared = self._env.reader_check()
        self._pid = os.getpid()
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(config.threads, "ctxstore")
        self._streams: dict[str, StreamWriter] = {}  # puts in progress in this process, by id
        self._lock = threading.Lock()
        self.orphans_swept = [] if config.readonly else self.sweep_orphans()

    @property
    def location(self) -> str:
        return self.config.location or str(self.path.resolve())

    def _intact(self, context_id: str | None = None) -> None:
        """Before a read transaction: the file is no smaller than it was seen before (LMDB only
        grows it, and a read of a page cut off its end is SIGBUS); a context read answers
        CorruptArtifact (DATA_LOSS)."""
        size = still_whole(self.path / "data.mdb", self._size_seen)
        if size is not None:
            self._size_seen = max(self._size_seen, size)
            return
        why = "data.mdb is shorter than it was seen before (truncated while open)"
        if context_id is not None:
            raise CorruptArtifact(context_id, "data.mdb", why)
        raise StoreDamaged(f"{self.path}: {why}")

    # ---- lifecycle -------------------------------------------------------------------------
    def _live(self) -> ThreadPoolExecutor:
        if self._pool is None:
            raise StoreClosed(f"store {self.path} is closed")
        if os.getpid() != self._pid:
            raise StoreClosed(f"store {self.path} was opened in pid {self._pid} and used in pid "
                              f"{os.getpid()}: open the store after fork, in the process using it")
        return self._pool

    def _writable(self) -> ThreadPoolExecutor:
        if self.config.readonly:
            raise StoreError(f"store {self.path} is open read-only")
        return self._live()

    def close(self) -> None:
        if self._pool is not None and os.getpid() == self._pid:
            for w in list(self._streams.values()):  # a put left unfinished: as a crash (swept at open)
                w.halt()
            self._streams.clear()
            self._pool.shutdown(wait=True)
            self._env.close()
        self._pool = None

    def __enter__(self) -> "ArtifactStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- write -----------------------------------------------------------------------------
    def put(self, context_id: str, artifact: ContextArtifact, meta: ContextMeta = ContextMeta()
            ) -> Manifest:
        """Store (or atomically replace) a context. Raises StoreFull when it cannot fit.
        The pool encodes (hashes, compresses) the chunks while the write transaction copies in
        those already encoded, so the two overlap (a 32K-token int8 artifact of Llama-3.1-8B
        shapes, 2.2 GB, spent 2.4 s encoding, then 9.2 s in LMDB, on a 2-core VM); room is made
        for the raw bytes first, an upper bound of the stored ones (codec.encode never grows a
        chunk), and the exact sizes decide when that bound does not fit."""
        pool = self._writable()
        self._not_streaming(check_id(context_id))
        chunks = chunk_tensors(artifact)  # once: a decoded layer is encoded to its kv codec here
        bound = raw_bytes(chunks)
        try:
            if bound > self.config.budget_bytes:
                raise StoreFull(f"{bound} raw bytes exceed the budget")
            self._make_room(bound, exclude=frozenset({context_id}))
        except StoreFull:  # the encoded chunks may fit where the raw ones do not
            manifest, payloads = encode_artifact(context_id, artifact, meta, self.config, pool, self._clock())
            return self.put_encoded(manifest, payloads)
        stream = ChunkStream(context_id, artifact, chunks, meta, self.config, pool, self._clock())
        return self._with_room(context_id, bound, lambda: self._write_stream(stream))

    def writer(self, context_id: str, meta: ContextMeta = ContextMeta()) -> ArtifactWriter:
        """A put whose layers are written as they are handed over, the manifest at `finish`
        (stream_writer.py). An id that has a manifest is replaced in one transaction at
        `finish` instead (DeferredWriter), so no reader ever sees old and new chunks mixed."""
        pool = self._writable()
        with self._env.begin() as txn:
            stored = txn.get(ManifestKey(check_id(context_id)).to_string().encode()) is not None
        with self._lock:
            self._not_streaming(context_id)
            if stored:
                return DeferredWriter(self, context_id, meta)
            w = self._streams[context_id] = StreamWriter(self, context_id, meta, pool, self._clock)
        return w

    def _not_streaming(self, context_id: str) -> None:
        if context_id in self._streams:
            raise StoreError(f"context {context_id} is being put already (one put per id at a time)")

    def _stream_ended(self, w: StreamWriter) -> None:
        with self._lock:
            if self._streams.get(w.context_id) is w:
                del self._streams[w.context_id]

    def sweep_orphans(self) -> list[str]:
        """Delete the chunks of ids without a manifest (a put killed mid-stream left them;
        nothing reads or counts them) but those of puts in progress here -> the ids."""
        self._writable()
        with self._env.begin() as txn:
            ids = [cid for cid in orphan_ids(txn) if cid not in self._streams]
        for cid in ids:  # one short transaction each; a manifest committed meanwhile stays
            with self._env.begin(write=True) as txn:
                if txn.get(ManifestKey(cid).to_string().encode()) is None:
                    delete_context(txn, cid)
        if ids:
            log.warning("swept the chunks of %d unfinished puts: %s", len(ids), ", ".join(i[:12] for i in ids[:5]))
        return ids

    def put_encoded(self, manifest: Manifest, payloads: Sequence[Payload]) -> Manifest:
        """Store chunks already encoded (and checked) elsewhere, e.g. fetched from the shared
        tier, under `manifest` as it is. Raises StoreFull when they cannot fit."""
        self._writable()
        cid = check_id(manifest.context_id)
        self._not_streaming(cid)
        if len(payloads) != len(manifest.chunks):
            raise ValueError(f"context {cid}: {len(payloads)} payloads for {len(manifest.chunks)} chunks")
        need = manifest.stored_bytes  # the budget counts chunk bytes (manifests are ~KB)
        if need > self.config.budget_bytes:
            raise StoreFull(f"context {cid} needs {need} bytes, over the store budget "
                            f"of {self.config.budget_bytes} bytes")
        self._make_room(need, exclude=frozenset({cid}))
        body, now = manifest.to_bytes(), self._clock()
        return self._with_room(cid, need, lambda: self._write(manifest, body, payloads, now))

    def _with_room(self, context_id: str, need: int, write: Callable[[], Any]) -> Any:
        """Run a write transaction; on MapFullError evict the LRU unpinned context and retry."""
        for _ in range(self.config.max_put_evictions + 1):
            try:
                return write()
            except lmdb.MapFullError:
                self._evict_one_for_map(context_id, need)
        raise StoreFull(f"context {context_id}: map still full after "
                        f"{self.config.max_put_evictions} evictions")

    def _write(self, m: Manifest, body: bytes, payloads: Sequence[Payload], now: float) -> Manifest:
        chunks = (((info.layer, info.name), payload) for info, payload in zip(m.chunks, payloads, strict=True))
        return self._write_txn(m.context_id, chunks, lambda: (m, body), now)

    def _write_stream(self, stream: ChunkStream) -> Manifest:
        """Each chunk as the pool finishes it, then the manifest of them all."""
        def manifest() -> tuple[Manifest, bytes]:
            m = stream.manifest()
            return m, m.to_bytes()
        return self._write_txn(stream.context_id, stream.payloads(), manifest, stream.now)

    def _write_txn(self, cid: str, chunks: Iterable[tuple[Slot, Payload]],
                   manifest: Callable[[], tuple[Manifest, bytes]], now: float) -> Manifest:
        """One transaction: the old chunks out, the new in, then the access time and manifest."""
        with self._env.begin(write=True) as txn:
            delete_context(txn, cid)  # replacing: drop the old chunks in the same txn
            for (layer, name), payload in chunks:
                txn.put(ChunkKey(cid, layer, name).to_string().encode(), payload)
            m, body = manifest()
            txn.put(AccessKey(cid).to_string().encode(), struct.pack("<d", now))
            txn.put(ManifestKey(cid).to_string().encode(), body)
        return m

    def _summaries(self) -> list[eviction.Summary]:
        now = self._clock()
        with self._env.begin() as txn:
            reads = scan_manifests(txn)
        # an unreadable manifest counts as least recently used (evicted first under pressure)
        # but not as expired, so a TTL sweep does not erase what verify() should report
        return [eviction.Summary(r.context_id, r.manifest.stored_bytes if r.manifest else 0,
                                 r.manifest.last_access if r.manifest else 0.0,
                                 bool(r.manifest and r.manifest.pinned),
                                 bool(r.manifest and r.manifest.expired(now))) for r in reads]

    def _make_room(self, need: int, exclude: frozenset[str]) -> int:
        """Evict until need bytes fit beside the stored contexts and the chunks of the other
        puts in progress -> the bytes left free after them."""
        need += sum(w.reserved for cid, w in list(self._streams.items()) if cid not in exclude)
        summaries = self._summaries()
        victims = eviction.victims_for(summaries, need, self.config.budget_bytes, exclude)
        if victims is None:
            raise StoreFull(f"{need} bytes do not fit the budget of {self.config.budget_bytes} "
                            "bytes even after evicting every unpinned context")
        for cid in victims:
            self.delete(cid)
        gone = frozenset(victims) | exclude
        return self.config.budget_bytes - need - sum(e.stored_bytes for e in summaries if e.context_id not in gone)

    def _evict_one_for_map(self, context_id: str, need: int) -> None:
        order = eviction.lru_order(self._summaries(), frozenset({context_id}))
        if not order:
            raise StoreFull(f"context {context_id} ({need} bytes) does not fit the LMDB map of "
                            f"{self.config.map_size_bytes} bytes and nothing is evictable")
        self.delete(order[0].context_id)

    def delete(self, context_id: str) -> bool:
        """Remove a context (manifest, access time, chunks) in one transaction."""
        self._writable()
        check_id(context_id)
        with self._env.begin(write=True) as txn:
            return delete_context(txn, context_id)

    def evict_expired(self) -> list[str]:
        """Delete contexts whose TTL has passed (pinned ones never expire); returns their ids."""
        gone = eviction.expired(self._summaries())
        return [cid for cid in gone if self.delete(cid)]

    def evict_to_budget(self, budget_bytes: int | None = None) -> list[str]:
        """Evict expired, then LRU unpinned contexts until stored bytes <= budget."""
        budget = self.config.budget_bytes if budget_bytes is None else budget_bytes
        summaries = self._summaries()
        victims = eviction.victims_for(summaries, 0, budget)
        if victims is None:  # pinned contexts alone exceed it: evict every unpinned one
            victims = [e.context_id for e in eviction.lru_order(summaries)]
        return [cid for cid in victims if self.delete(cid)]

    def update_meta(self, context_id: str, *, pinned: bool | None = None,
                    ttl_s: float | None | type[...] = ..., labels: Mapping[str, str] | None = None
                    ) -> Manifest | None:
        """Change pin / TTL (counted from now; None = no expiry) / labels of a stored context."""
        self._writable()
        check_id(context_id)
        if ttl_s is not ...:
            ContextMeta(ttl_s=ttl_s)  # validates
        if labels is not None:
            labels = dict(ContextMeta(labels=dict(labels)).labels)
        return self._with_room(context_id, 0, lambda: self._rewrite_meta(
            context_id, pinned, ttl_s, labels))

    def _rewrite_meta(self, context_id: str, pinned: bool | None, ttl_s: Any,
                      labels: dict[str, str] | None) -> Manifest | None:
        with self._env.begin(write=True) as txn:
            m = read_manifest(txn, context_id).manifest
            if m is None:
                return None
            changes: dict[str, Any] = {} if pinned is None else {"pinned": bool(pinned)}
            if ttl_s is not ...:
                changes["ttl_s"] = None if ttl_s is None else self._clock() - m.created_at + ttl_s
            if labels is not None:
                changes["labels"] = labels
            new = replace(m, **changes)
            txn.put(ManifestKey(context_id).to_string().encode(), new.to_bytes())
            return new

    # ---- read ------------------------------------------------------------------------------
    def get(self, context_id: str, with_queries: bool = False) -> ContextArtifact | None:
        """The artifact, or None if absent/expired. Raises CorruptArtifact (DATA_LOSS).
        with_queries: also read the stored prefill query sample (Rebuild needs it; decoding
        does not, so it is skipped by default and costs no load time)."""
        pool = self._live()
        check_id(context_id)
        self._intact(context_id)
        with self._env.begin(buffers=True) as txn:
            m = self._visible(read_manifest(txn, context_id))
            if m is None:
                return None
            chunks = [c for c in m.chunks if with_queries or c.name != QUERY_CHUNK]
            bufs = [txn.get(ChunkKey(context_id, c.layer, c.name).to_string().encode()) for c in chunks]
            c = self.config
            art = decode_chunks(m, chunks, bufs, pool, c.verify_on_load, c.huge_pages, c.pin_memory)
        self._touch(m)
        return art

    def _visible(self, read: ManifestRead) -> Manifest | None:
        if read.unsupported is not None:
            raise FormatMismatch(read.context_id, "store_format", read.unsupported, READABLE_STORE_FORMATS)
        if read.error:
            raise CorruptArtifact(read.context_id, "manifest", read.error)
        m = read.manifest
        if m is not None and m.format_version not in READABLE_FORMATS:
            raise FormatMismatch(m.context_id, "format_version", m.format_version, READABLE_FORMATS)
        return None if m is None or m.expired(self._clock()) else m

    def _touch(self, m: Manifest) -> None:
        now = self._clock()
        if (not self.config.track_access or self.config.readonly
                or now - m.last_access < self.config.access_granularity_s):
            return
        try:
            with self._env.begin(write=True) as txn:
                if txn.get(ManifestKey(m.context_id).to_string().encode()) is not None:
                    txn.put(AccessKey(m.context_id).to_string().encode(), struct.pack("<d", now))
        except lmdb.MapFullError:
            pass  # the access time is a hint for LRU; a full map must not fail a read

    def manifest(self, context_id: str) -> Manifest | None:
        self._live()
        self._intact(context_id)
        with self._env.begin() as txn:
            return self._visible(read_manifest(txn, check_id(context_id)))

    def list_manifests(self, offset: int = 0, limit: int = 100,
                       labels: Mapping[str, str] | None = None, tenant: str | None = None,
                       after: str | None = None) -> list[Manifest]:
        """Manifests in id order, skipping expired and corrupt ones (verify reports those).

        labels: every given label must match; after: resume after this context id (paging)."""
        self._live()
        if offset < 0 or limit < 0:
            raise ValueError(f"offset={offset} and limit={limit} must be >= 0")
        want = dict(labels or {})
        now = self._clock()
        self._intact()
        with self._env.begin() as txn:
            reads = scan_manifests(txn, after)
        ms = [r.manifest for r in reads if r.manifest and not r.manifest.expired(now)]
        ms = [m for m in ms if (tenant is None or m.tenant == tenant)
              and all(m.labels.get(k) == v for k, v in want.items())]
        return ms[offset:offset + limit]

    def context_ids(self) -> list[str]:
        """Every context with a manifest, corrupt or expired ones included."""
        self._live()
        self._intact()
        with self._env.begin() as txn:
            return [r.context_id for r in scan_manifests(txn)]

    def verify(self, context_id: str) -> VerifyReport:
        """Hash every stored chunk of a context against its manifest."""
        self._live()
        self._intact(context_id)
        with self._env.begin(buffers=True) as txn:
            return verify_chunks(txn, check_id(context_id))

    def stats(self) -> StoreStats:
        self._live()
        self._intact()
        with self._env.begin() as txn:
            reads = scan_manifests(txn)
        ms = [r.manifest for r in reads if r.manifest]
        info, st = self._env.info(), self._env.stat()
        return StoreStats(
            contexts=len(ms), pinned=sum(m.pinned for m in ms),
            corrupt_manifests=len(reads) - len(ms), stored_bytes=sum(m.stored_bytes for m in ms),
            raw_bytes=sum(m.raw_bytes() for m in ms), raw_kv_bytes=sum(m.raw_kv_bytes for m in ms),
            raw_table_bytes=sum(m.raw_table_bytes for m in ms),
            budget_bytes=self.config.budget_bytes, map_size_bytes=info["map_size"],
            map_used_bytes=(info["last_pgno"] + 1) * st["psize"])


__all__ = ["ArtifactStore", "prefix"]
