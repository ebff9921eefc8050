"""StreamWriter: one put into LMDB whose layers are written as the build hands them over.

Why: LMDB's put used to be one transaction at `finish` (DeferredWriter): on an H200 a 32K
PutContext (Llama-3.1-8B, int8 K/V, 2.1 GB) spent ~3 s encoding, copying and committing after
a 1.8 s build (READY at 2.86x the prefill). Here each hand-over's chunks are encoded on the
store's pool (after `ready()`: a GPU build's host copies land first) and committed by this
put's writer thread, one short write transaction per hand-over (a layer's chunks, ~65 MB at
32K), so a delete, an access-time touch or another put waits for one layer, not a build.

Visibility: chunk keys without a manifest are invisible (get, list, stats, the budget's
eviction and verify read manifests only). `finish` stores what was not handed over (the
context-wide chunks; every chunk when no layer was, one layer per transaction), then checks
in the last transaction that every chunk key is there at its manifest size and commits the
access key and manifest: READY from that commit, as before. A context that already has a
manifest is never streamed (ArtifactStore.writer returns a DeferredWriter: one transaction
replaces the old chunks with the new, so no reader sees a mix).

Failure: the first failed chunk stops the write (the next hand-over or `finish` raises it);
`abort` (and any exception in `finish`) deletes the chunks written so far. A process killed
mid-put leaves chunk keys without a manifest, which the store sweeps when it opens.
Room: before each transaction room is made for every byte this put has stored plus the new
chunks' exact (encoded) sizes, counted with the other puts in progress (`reserved`); a
MapFullError evicts LRU contexts and retries that transaction only (the committed ones stay).
Durability: with `StoreConfig.sync` every commit is fsynced, so the chunks are durable before
the manifest's commit; without it nothing is fsynced (a process crash is safe either way).
Memory: a raw chunk's payload is a view of the tensor the build holds anyway, so hand-overs
are not bounded as the object writer's uploads are (no bytes are queued beyond the artifact).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import queue
import struct
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import lmdb
import torch

from ctxcache.artifact import ContextArtifact, LayerArtifact
from ctxcache.store import codec
from ctxcache.store.artifact_writer import landed
from ctxcache.store.errors import StoreClosed, StoreError, StoreFull, WriteStopped
from ctxcache.store.keys import AccessKey, ChunkKey, ManifestKey, check_id
from ctxcache.store.layout import Slot, build_manifest, chunk_tensors, layer_chunks
from ctxcache.store.lmdb.txn_ops import delete_context
from ctxcache.store.manifest import ContextMeta, Manifest

if TYPE_CHECKING:
    from ctxcache.store.lmdb.artifact_store import ArtifactStore

log = logging.getLogger("ctxcache.store.lmdb")

Batch = list[tuple[Slot, cf.Future]]  # one transaction's chunks, each encoding on the pool



def _key(cid: str, slot: Slot) -> bytes:
    return ChunkKey(cid, *slot).to_string().encode()


class StreamWriter:
    def __init__(self, store: "ArtifactStore", context_id: str, meta: ContextMeta,
                 pool: cf.Executor, clock: Callable[[], float] = time.time) -> None:
        """Registered with the store by ArtifactStore.writer (one put per id at a time)."""
        self.store, self.context_id, self.meta = store, check_id(context_id), meta
        self._pool, self._clock = pool, clock
        self._jobs: dict[Slot, tuple[torch.Tensor, cf.Future]] = {}
        self._sizes: dict[Slot, int] = {}  # stored bytes of each chunk committed (the writer thread's)
        self.reserved = 0  # what the store counts for this put in the budget (its chunks so far)
        self._granted = 0  # bytes room was made for: up to it no eviction scan is needed
        self._first = True  # the first transaction clears stale chunk keys of the id
        self._queue: queue.SimpleQueue[Batch | None] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._done = False  # finished, aborted or halted: queued chunks are skipped
        # started by the first chunks (a writer given nothing until finish holds no thread)
        self._thread = threading.Thread(target=self._run, name=f"ctxstore-put-{self.context_id[:12]}",
                                        daemon=True)

    # ---- hand-over ---------------------------------------------------------------------------
    def add_layer(self, index: int, layer: LayerArtifact, kv_codec: str,
                  ready: Callable[[], None] = landed) -> None:
        new = [(slot, t) for slot, t in layer_chunks(index, layer, kv_codec)
               if slot not in self._jobs or self._jobs[slot][0] is not t]  # handed over again: what is new
        self._enqueue(new, ready)

    def _enqueue(self, chunks: list[tuple[Slot, torch.Tensor]], ready: Callable[[], None]) -> None:
        self._raise_if_failed()
        if self._done:
            raise WriteStopped(f"context {self.context_id}: its put was given up")
        if not chunks:
            return
        batch: Batch = []
        for slot, t in chunks:
            future = self._pool.submit(self._encode, t, ready)
            self._jobs[slot] = (t, future)
            batch.append((slot, future))
        self._queue.put(batch)  # FIFO: a slot handed over again is rewritten after its first write
        if self._thread.ident is None:
            self._thread.start()

    def _encode(self, t: torch.Tensor, ready: Callable[[], None]) -> codec.Encoded:
        if self._error is not None or self._done:
            raise WriteStopped(f"context {self.context_id}: chunk skipped, its put stopped")
        ready()
        c = self.store.config
        return codec.encode(t, c.zstd_level, c.min_gain, c.sample_bytes)

    # ---- the writer thread: LMDB write transactions stay on the thread that opened them -------
    def _run(self) -> None:
        while (batch := self._queue.get()) is not None:
            if self._error is not None or self._done:
                continue  # stopped: the rest is skipped (its futures were cancelled or fail fast)
            try:
                self._write([(slot, f.result()) for slot, f in batch])
            except BaseException as exc:  # noqa: BLE001 - kept, raised by the next call
                if self._error is None and not isinstance(exc, (WriteStopped, cf.CancelledError)):
                    self._error = exc

    def _write(self, encoded: list[tuple[Slot, codec.Encoded]]) -> None:
        sizes = {slot: len(memoryview(e.payload).cast("B")) for slot, e in encoded}
        need = sum({**self._sizes, **sizes}.values())  # a chunk rewritten counts once
        self._room(need)
        self.store._with_room(self.context_id, need, lambda: self._put(encoded))
        self._sizes.update(sizes)
        self._first = False

    def _room(self, need: int) -> None:
        if need > self._granted:
            try:
                self._granted = need + self.store._make_room(need, exclude=frozenset({self.context_id}))
            except StoreFull as exc:
                raise StoreFull(f"context {self.context_id} (streamed, {need} bytes so far): {exc}") from None
        self.reserved = need

    def _put(self, encoded: list[tuple[Slot, codec.Encoded]]) -> None:
        with self.store._env.begin(write=True) as txn:
            if self._first:  # chunk keys of an earlier put of this id that never committed
                if txn.get(ManifestKey(self.context_id).to_string().encode()) is not None:
                    raise StoreError(f"context {self.context_id} got a manifest while its put streamed")
                delete_context(txn, self.context_id)
            for slot, e in encoded:
                txn.put(_key(self.context_id, slot), e.payload)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _drain(self) -> None:
        """Let the writer thread write (or skip) what is queued, then end."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    # ---- commit ------------------------------------------------------------------------------
    def finish(self, artifact: ContextArtifact) -> Manifest:
        """Write what was not handed over, wait for every chunk, then the manifest: READY."""
        try:
            self.store._live()
            chunks = chunk_tensors(artifact)
            self._check_slots({slot for slot, _ in chunks})
            rest = [(slot, t) for slot, t in chunks if slot not in self._jobs or self._jobs[slot][0] is not t]
            for layer in dict.fromkeys(slot[0] for slot, _ in rest):  # one transaction per layer
                self._enqueue([(slot, t) for slot, t in rest if slot[0] == layer], landed)
            self._drain()
            self._raise_if_failed()
            if self._done:
                raise WriteStopped(f"context {self.context_id}: its put was given up")
            slots, tensors = zip(*chunks)
            encoded = [self._jobs[slot][1].result() for slot in slots]
            m = build_manifest(self.context_id, artifact, self.meta, slots, tensors, encoded, self._clock())
            self.store._with_room(self.context_id, m.stored_bytes, lambda: self._commit(m))
        except BaseException:
            self.abort()
            raise
        self._done = True
        self.store._stream_ended(self)
        return m

    def _check_slots(self, wanted: set[Slot]) -> None:
        extra = sorted(set(self._jobs) - wanted, key=str)
        if extra:
            raise ValueError(f"context {self.context_id}: chunks {extra[:3]} were handed over but the "
                             "artifact has none such")

    def _commit(self, m: Manifest) -> None:
        """The last transaction: every chunk there at its size (a delete, or another process's
        sweep, may have removed some meanwhile), then the access time and the manifest."""
        cid = m.context_id
        with self.store._env.begin(write=True, buffers=True) as txn:
            for c in m.chunks:
                buf = txn.get(_key(cid, (c.layer, c.name)))
                if buf is None or len(buf) != c.stored_bytes:
                    raise StoreError(f"context {cid}: chunk {c.label()} "
                                     f"{'is missing' if buf is None else 'has another size'} at commit "
                                     "(deleted while its put streamed?)")
            txn.put(AccessKey(cid).to_string().encode(), struct.pack("<d", m.created_at))
            txn.put(ManifestKey(cid).to_string().encode(), m.to_bytes())

    def abort(self) -> None:
        """Give the put up: queued chunks are skipped, and once the writer thread ends the
        chunks written so far are deleted (unless a manifest names them: never a mix)."""
        if self._done:
            return
        self._done = True
        for _, future in list(self._jobs.values()):
            future.cancel()
        self._drain()
        try:
            self._remove()
        except (StoreClosed, lmdb.Error) as exc:  # the store closed: its next open sweeps them
            log.warning("put of %s aborted, its chunks left to the next open's sweep: %s",
                        self.context_id[:12], exc)
        finally:
            self.store._stream_ended(self)

    def _remove(self) -> None:
        """A manifest commit is atomic: if it is there, it and its chunks stay."""
        self.store._writable()
        with self.store._env.begin(write=True) as txn:
            if txn.get(ManifestKey(self.context_id).to_string().encode()) is None:
                delete_context(txn, self.context_id)

    def halt(self) -> None:
        """The store closes under this put: stop writing, delete nothing (as a crash would; the
        next open sweeps the chunks)."""
        self._done = True
        for _, future in list(self._jobs.values()):
            future.cancel()
        self._drain()
