"""The indexer role: build jobs from the Redis stream, one at a time, on the BuildQueue.

A Rebuild's job names its source context: the indexer reads those K/V from the object store
and re-indexes them (no prefill). Per job: `start` in the registry (skipped when READY
already, deleted or superseded, failed after MAX_ATTEMPTS indexers died on it), build, and
while building, every `beat` seconds,
publish progress (False back means the context was deleted: cancel) and keep the stream entry
fresh (False back means another indexer took it over: stop). The entry is acknowledged once
the artifact is in the object store and the registry says READY (or FAILED); an indexer that
dies before that leaves the entry pending, and another takes it after the lease.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace

from ctxcache.indexer import job_spec
from ctxcache.indexer.build_queue import BuildQueue, Job
from ctxcache.indexer.seams import FleetBuildBackend
from ctxcache.errors import ServiceError, failure_text
from ctxcache.store import RegistryUnavailable
from ctxcache.store.registries.fleet_registry import FleetRegistry
from ctxcache.store.registries.job_stream import JobStream, TakenJob

log = logging.getLogger("ctxcache.service.fleet")
MAX_ATTEMPTS = 3  # a job whose indexers died this often fails instead of killing more


class FleetIndexer:
    def __init__(self, builds: BuildQueue, backend: FleetBuildBackend, stream: JobStream, name: str,
                 lease_s: float, claim_s: float) -> None:
        self.builds, self.backend, self.stream, self.name = builds, backend, stream, name
        self.fleet: FleetRegistry = backend.fleet
        self.beat, self.claim_s = min(0.25, lease_s / 4), claim_s
        self.lease_s = lease_s
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ctxcache-fleet-indexer", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._closed.is_set():
            try:
                taken = self.stream.take()
            except RegistryUnavailable as exc:
                log.warning("job stream unavailable: %s", exc)
                self._closed.wait(1.0)
                continue
            if taken is None:
                continue
            try:
                self._run(taken)
            except RegistryUnavailable as exc:  # left pending: this or another indexer retakes it
                log.warning("job %s left pending, registry unavailable: %s", taken.context_id[:12], exc)
                self._closed.wait(1.0)
            except Exception:  # noqa: BLE001 - the loop outlives any one job; the entry stays pending
                log.exception("job %s: unexpected failure; left pending", taken.context_id[:12])
                self._closed.wait(1.0)

    def _run(self, t: TakenJob) -> None:
        cid = t.context_id
        attempts = self.fleet.start(cid, t.job_id, self.name, self.claim_s)
        if attempts == 0:
            log.info("job %s: no longer wanted (ready, deleted or superseded)", cid[:12])
        elif attempts > MAX_ATTEMPTS:
            self.fleet.fail(cid, t.job_id, f"{attempts - 1} indexers stopped while building it")
        elif not self._build(t, attempts):
            return  # another indexer owns it now, or this one is stopping and handed it back
        self.stream.ack(t.entry_id)

    def _build(self, t: TakenJob, attempts: int) -> bool:
        """-> whether the job is settled (READY, FAILED or deleted) and may be acknowledged."""
        cid, facts = t.context_id, self.fleet.facts(t.context_id)
        try:
            spec = job_spec.from_json(facts.spec if facts is not None else "")
            if (mine := self.builds.context_id(spec, t.tokens)) != cid:
                raise ValueError(f"this indexer computes context id {mine[:12]}... for the job: its model, "
                                 "tokenizer or format differs from the decoder's")
            _, job, _ = self.builds.submit(spec, t.tokens, self._source(facts.spec))
        except (ValueError, ServiceError) as exc:
            self.fleet.fail(cid, t.job_id, failure_text(exc))
            return True
        log.info("job %s: building (attempt %d)", cid[:12], attempts)
        if job is not None and not self._follow(t, job):
            return False
        if job is not None and job.state != "ready":
            if self._closed.is_set():
                self.stream.release(t.entry_id)  # stopping: the next indexer takes it at once
                return False
            if not job.token.cancelled:
                self.fleet.fail(cid, t.job_id, job.error)
            return True
        if not self.fleet.finish(cid, t.job_id, self.backend.artifact_uri(cid)):
            log.info("job %s: deleted while it was written; removing the artifact", cid[:12])
            self.backend.store.delete(cid)
        return True

    def _source(self, spec_json: str) -> job_spec.Reindex | None:
        """A Rebuild's source K/V, read through this worker's store from the object store."""
        src = job_spec.source_of(spec_json)
        if src is None:
            return None
        art = self.backend.get(src.context_id, with_queries=src.with_queries)
        if art is None:
            raise ValueError(f"the Rebuild's source context {src.context_id} is gone from the object store")
        return replace(src, artifact=art)

    def _follow(self, t: TakenJob, job: Job) -> bool:
        """Wait for the build, beating; False if it was taken over (leave the job alone)."""
        last_keep = time.monotonic()
        while not job.done.wait(self.beat):
            if not self._beat(lambda: self.fleet.progress(t.context_id, t.job_id, job.progress, self.claim_s)):
                self.builds.cancel(t.context_id, "deleted by DeleteContext", wait_s=0)
            if time.monotonic() - last_keep >= self.lease_s / 3:
                last_keep = time.monotonic()
                if not self._beat(lambda: self.stream.keep_alive(t.entry_id)):
                    log.warning("job %s was taken over by another indexer; stopping", t.context_id[:12])
                    self.builds.cancel(t.context_id, "taken over by another indexer", wait_s=5)
                    return False
        return True

    @staticmethod
    def _beat(call) -> bool:  # noqa: ANN001
        """A beat that cannot reach Redis is skipped (the build goes on; the lease is the bound)."""
        try:
            return bool(call())
        except RegistryUnavailable:
            return True

    def close(self) -> None:
        """Stop taking jobs; a build in flight is cancelled by the BuildQueue's close (after
        this) and its job handed back."""
        self._closed.set()

    def join(self) -> None:
        self._thread.join(5)
        self.stream.close()
