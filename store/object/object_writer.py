"""ObjectWriter: one write of an artifact to the object store, each chunk uploaded as soon as
the build hands its layer over, the manifest last.

Why: a PutContext's upload used to start only once every chunk was encoded, because a write's
object keys hashed its whole manifest; on an H200 that put 2.1 GB (32K) to 8 GB (124K) of
uploads at about 0.9 GB/s after the build (PutContext 3.6x / 1.6x the prefill). Here the write
id is chosen first (object_layout.new_write_id), so the keys are known before any chunk is
encoded, and each layer's chunks are encoded and uploaded on the store's put pool while the
build computes the next layer. The manifest, which names the write id and every chunk's sizes
and checksums, goes up last: a context is visible (READY) only once it lands.

Memory: chunks handed over and not yet uploaded hold at most `put_inflight_bytes` (a hand-over
beyond that waits for uploads: the build slows to the store's pace instead of queueing bytes).
Failure: the first failed upload stops the write (the next hand-over or `finish` raises it, the
queued chunks are skipped), and `abort` removes the write's folder once its running uploads end
(again once the breaker the failure opened has shut); if the store cannot be reached for that,
its chunks are an orphan write that `gc` removes after its grace period.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ctxcache.artifact import ContextArtifact, LayerArtifact
from ctxcache.store import codec
from ctxcache.store.artifact_writer import landed
from ctxcache.store.chunk_io import Payload
from ctxcache.store.config import StoreConfig
from ctxcache.store.errors import StoreError, WriteStopped
from ctxcache.store.keys import check_id
from ctxcache.store.layout import Slot, build_manifest, chunk_tensors, layer_chunks
from ctxcache.store.manifest import ContextMeta, Manifest
from ctxcache.store.object import object_layout as lay

if TYPE_CHECKING:
    from ctxcache.store.object.object_store import ObjectArtifactStore

log = logging.getLogger("ctxcache.store.object")



class Inflight:
    """Bytes handed over and not yet uploaded, at most `limit` (one chunk alone may exceed it)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.held = limit, 0
        self._cv = threading.Condition()
        self._stopped = False

    def take(self, n: int) -> bool:
        """Wait for room for n bytes -> True; False once `stop` was called (nothing taken)."""
        with self._cv:
            self._cv.wait_for(lambda: self._stopped or self.held == 0 or self.held + n <= self.limit)
            if self._stopped:
                return False
            self.held += n
            return True

    def give(self, n: int) -> None:
        with self._cv:
            self.held -= n
            self._cv.notify_all()

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()


class ObjectWriter:
    def __init__(self, store: "ObjectArtifactStore", context_id: str, meta: ContextMeta, config: StoreConfig,
                 pool: cf.Executor, inflight_bytes: int, clock: Callable[[], float] = time.time) -> None:
        """config: how chunks are encoded (StoreConfig's codec fields); pool: where each chunk
        is encoded and uploaded; clock: the manifest's creation time (taken at finish)."""
        self.store, self.context_id, self.meta = store, check_id(context_id), meta
        self.config, self._pool, self._clock = config, pool, clock
        self.write_id = lay.new_write_id()
        self._jobs: dict[Slot, tuple[torch.Tensor, cf.Future]] = {}
        self._inflight = Inflight(inflight_bytes)
        self._lock = threading.Lock()
        self._error: BaseException | None = None  # the first failed chunk's
        self._done = False  # finished or aborted
        self._published = False  # the manifest's PUT was tried: its chunks are never removed here

    # ---- hand-over ---------------------------------------------------------------------------
    def add_layer(self, index: int, layer: LayerArtifact, kv_codec: str,
                  ready: Callable[[], None] = landed) -> None:
        for slot, t in layer_chunks(index, layer, kv_codec):
            job = self._jobs.get(slot)
            if job is None or job[0] is not t:  # a layer handed over again uploads only what is new
                self._submit(slot, t, ready)

    def _submit(self, slot: Slot, t: torch.Tensor, ready: Callable[[], None]) -> None:
        self._raise_if_failed()
        n = t.numel() * t.element_size()
        if not self._inflight.take(n):
            self._raise_if_failed()
            raise WriteStopped(f"context {self.context_id}: write {self.write_id} was given up")
        try:
            self._jobs[slot] = (t, self._pool.submit(self._upload, slot, t, ready, n))
        except BaseException:
            self._inflight.give(n)
            raise

    def _upload(self, slot: Slot, t: torch.Tensor, ready: Callable[[], None], n: int) -> codec.Encoded:
        try:
            if self._error is not None or self._done:
                raise WriteStopped(f"context {self.context_id}: chunk {slot} skipped, its write stopped")
            ready()
            c = self.config
            enc = codec.encode(t, c.zstd_level, c.min_gain, c.sample_bytes)
            # put_many: the tier's deadline for a whole object (a single put's is a manifest's)
            self.store.tier.put_many([(lay.slot_key(self.context_id, self.write_id, *slot), enc.payload)])
            return enc
        except BaseException as exc:
            self._failed(exc)
            raise
        finally:
            self._inflight.give(n)

    def _failed(self, exc: BaseException) -> None:
        with self._lock:
            if self._error is None and not isinstance(exc, WriteStopped):
                self._error = exc
        self._inflight.stop()  # a hand-over waiting for room raises instead

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    # ---- commit ------------------------------------------------------------------------------
    def finish(self, artifact: ContextArtifact) -> Manifest:
        return self.finish_encoded(artifact)[0]

    def finish_encoded(self, artifact: ContextArtifact) -> tuple[Manifest, list[Payload]]:
        """Upload what was not handed over, wait for every chunk, then the manifest -> it and
        each chunk's stored bytes (a local cache keeps them). Any failure aborts the write."""
        try:
            chunks = chunk_tensors(artifact)
            self._check_slots({slot for slot, _ in chunks})
            for slot, t in chunks:
                job = self._jobs.get(slot)
                if job is None or job[0] is not t:  # not handed over (or not these tensors)
                    if job is not None:
                        cf.wait([job[1]])  # one upload per key at a time
                    self._submit(slot, t, landed)
            futures = [self._jobs[slot][1] for slot, _ in chunks]
            cf.wait(futures)
            self._raise_if_failed()
            encoded = [f.result() for f in futures]
            slots, tensors = zip(*chunks)
            m = build_manifest(self.context_id, artifact, self.meta, slots, tensors, encoded,
                               self._clock()).named(self.write_id)
            old = self.store.make_way(m)
            self._published = True  # from here a failure may still have landed the manifest
            self.store.publish(m, old)
        except BaseException:
            self.abort()
            raise
        self._done = True
        return m, [e.payload for e in encoded]

    def _check_slots(self, wanted: set[Slot]) -> None:
        extra = sorted(set(self._jobs) - wanted, key=str)
        if extra:
            raise ValueError(f"context {self.context_id}: chunks {extra[:3]} were handed over but the "
                             "artifact has none such")

    def abort(self) -> None:
        """Give the write up: queued chunks are skipped, and once the running uploads end the
        write's folder is deleted (if the store does not answer, gc removes it later)."""
        if self._done:
            return
        self._done = True
        self._inflight.stop()
        futures = [f for _, f in self._jobs.values()]
        for f in futures:
            f.cancel()
        cf.wait(futures)
        folder = lay.write_folder(self.context_id, self.write_id)
        if self._published:  # a manifest PUT that timed out may land: gc decides once it is old
            log.warning("write %s of %s left to gc: its manifest may have landed", self.write_id, self.context_id[:12])
            return
        self._remove(folder, retry=True)

    def _remove(self, folder: str, retry: bool) -> None:
        try:
            self.store.tier.delete_prefix(folder)
        except StoreError as exc:
            if retry:  # the failure that stopped the write opened the breaker (tiers/guard.py): once it is shut
                again = threading.Timer(self.store.tier.guard_config.open_s + 0.1, self._remove, (folder, False))
                again.daemon = True
                again.start()
            else:
                log.warning("write %s of %s not removed (gc removes it): %s", self.write_id, self.context_id[:12], exc)
