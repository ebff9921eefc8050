"""The decoder role's builds: PutContext enqueues a job for the indexers instead of building.

`RemoteBuilds` offers what the servicers use of a BuildQueue (submit, cancel, job, tenant_of,
counts, queued); its jobs (`RemoteJob`, the fields of build_queue.Job the servicers read)
follow the registry: one watcher thread polls the entries of the builds this decoder's callers
wait for, so PutContext(wait) and GetContext see progress, READY and FAILED from any indexer.
"""

from __future__ import annotations

import logging
import threading

from ctxcache.cancel import CancelToken
from ctxcache.methods import make_method
from ctxcache.models.loader import LoadedModel
from ctxcache.indexer import job_spec
from ctxcache.indexer.build_queue import BuildQueue
from ctxcache.errors import ResourceExhausted, Unavailable
from ctxcache.indexer.job_spec import PutSpec
from ctxcache.indexer.seams import FleetBuildBackend
from ctxcache.indexer.settings import IndexerSettings
from ctxcache.metrics import Metrics
from ctxcache.prompting import Prompter
from ctxcache.store import CorruptArtifact, RegistryUnavailable
from ctxcache.store.registries.fleet_registry import Enqueued, Facts, FleetState
from ctxcache.store.registries.job_stream import JobStream

log = logging.getLogger("ctxcache.service.fleet")


class RemoteJob:
    """A build running on some indexer, as this decoder sees it through the registry."""

    def __init__(self, context_id: str, spec: PutSpec, n_tokens: int) -> None:
        self.context_id, self.spec, self.tokens = context_id, spec, range(n_tokens)  # len() = its tokens
        self.state, self.progress, self.error = "building", 0.0, ""
        self.done = threading.Event()
        self.token = CancelToken()  # cancelled when this decoder stops waiting for it (its drain)

    @classmethod
    def from_facts(cls, f: Facts) -> "RemoteJob | None":
        try:
            job = cls(f.context_id, job_spec.from_json(f.spec), f.n_tokens)
        except ValueError:
            return None
        job.update(f)
        return job

    def update(self, f: Facts | None) -> None:
        if f is None or f.state == FleetState.DELETED:
            self.state, self.error = "failed", "cancelled: deleted" if f is not None else "cancelled: the job is gone"
        elif f.state == FleetState.READY:
            self.state, self.progress = "ready", 1.0
        elif f.state == FleetState.FAILED:
            self.state, self.error = "failed", f.error
        else:
            self.progress = f.progress
            return
        self.done.set()


class RemoteBuilds:
    def __init__(self, lm: LoadedModel, prompter: Prompter, backend: FleetBuildBackend, stream: JobStream,
                 settings: IndexerSettings, kv_dtype: str, metrics: Metrics, claim_s: float,
                 poll_s: float = 0.05) -> None:
        self.lm, self.prompter, self.backend, self.settings = lm, prompter, backend, settings
        self.stream, self.kv_dtype, self.metrics, self.claim_s = stream, kv_dtype, metrics, claim_s
        self.fleet = backend.fleet
        self.max_tokens = settings.max_context_tokens or max(1, lm.args.max_seq_len - 256)
        self.max_tokens_why = f"model maximum {lm.args.max_seq_len}"  # a GPU decoder's slots may lower both
        default = make_method(settings.method, settings.method_params)
        self._default = (default.name, default.params)
        self._jobs: dict[str, RemoteJob] = {}  # the builds this decoder's callers wait for (jobs() lists them)
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(poll_s,), name="ctxcache-fleet-jobs", daemon=True)
        self._thread.start()

    # the indexers' own formulas (one definition: an indexer recomputes the id and refuses a mismatch)
    context_id = BuildQueue.context_id
    tokens = BuildQueue.tokens
    admitted = BuildQueue.admitted  # the indexers' admission of parameters and a build's cost
    _check_work = BuildQueue._check_work

    def submit(self, spec: PutSpec, tokens: list[int] | None = None,
               source: job_spec.Reindex | None = None) -> tuple[str, RemoteJob | None, bool]:
        """-> (context id, the job if building, whether this call queued it). source: a Rebuild's;
        the job names it and the indexer reads its K/V from the object store."""
        method, tokens = self.admitted(spec, tokens)  # refused here, not FAILED on an indexer
        cid = self.context_id(spec, tokens)
        if self.backend.existing(cid) is not None:  # a DAMAGED one is built again
            self.metrics.put_requests.labels("existing").inc()
            return cid, None, False
        try:
            if self.stream.waiting() >= self.settings.queue_limit:
                self.metrics.rejected.labels("PutContext").inc()
                raise ResourceExhausted(f"{self.settings.queue_limit} builds queued for the indexers; retry later")
            outcome, _ = self.fleet.enqueue(cid, tokens, job_spec.to_json(spec, source), spec.tenant, self.claim_s)
        except RegistryUnavailable as exc:
            raise Unavailable("registry unavailable, cannot start a build", detail=exc) from exc
        self.metrics.put_requests.labels("created" if outcome == Enqueued.QUEUED else "joined").inc()
        return cid, self._watch_job(cid, spec, len(tokens)), outcome == Enqueued.QUEUED

    def _watch_job(self, cid: str, spec: PutSpec, n_tokens: int) -> RemoteJob:
        with self._lock:
            job = self._jobs.get(cid)
            if job is None or job.done.is_set():
                job = self._jobs[cid] = RemoteJob(cid, spec, n_tokens)
            return job

    def _watch(self, poll_s: float) -> None:
        while not self._closed.wait(poll_s):
            with self._lock:
                jobs = list(self._jobs.values())
            for job in jobs:
                try:
                    job.update(self.fleet.facts(job.context_id))
                except RegistryUnavailable:
                    continue  # the waiting Put's own deadline bounds it
                if job.done.is_set():
                    with self._lock:
                        if self._jobs.get(job.context_id) is job:
                            del self._jobs[job.context_id]

    def cancel(self, cid: str, reason: str = "cancelled", wait_s: float = 2.0) -> bool:
        """Whether cid is building; the DeleteContext / Evict that follows stops the indexer
        (its tombstone is seen at the build's next progress beat)."""
        f = self.backend.facts(cid)
        return f is not None and f.state == FleetState.BUILDING

    def job(self, cid: str) -> RemoteJob | None:
        with self._lock:
            job = self._jobs.get(cid)
        if job is not None:
            return job
        f = self.backend.facts(cid)
        if f is None or f.state not in (FleetState.BUILDING, FleetState.FAILED):
            return None
        return RemoteJob.from_facts(f)

    def jobs(self) -> list[RemoteJob]:
        with self._lock:
            return list(self._jobs.values())

    def tenant_of(self, cid: str) -> str | None:
        try:
            m = self.backend.manifest(cid)
        except CorruptArtifact:  # DAMAGED: the registry's entry names the tenant
            m = None
        if m is not None:
            return m.tenant
        f = self.backend.facts(cid)
        return f.tenant if f is not None and f.state != FleetState.DELETED else None

    def counts(self) -> tuple[int, int]:
        """-> (builds this decoder's callers wait for, 0): failures live in the registry."""
        with self._lock:
            return sum(not j.done.is_set() for j in self._jobs.values()), 0

    def queued(self) -> int:
        try:
            return self.stream.waiting()
        except RegistryUnavailable:
            return 0

    def close(self, timeout: float = 5.0) -> None:
        self._closed.set()
        self._thread.join(timeout)
        with self._lock:
            for job in self._jobs.values():
                job.state, job.error = "failed", "the server is shutting down"
                job.token.cancel(job.error)
                job.done.set()
        self.stream.close()
