"""Build queue: PutContext builds, queued, idempotent, fair across tenants.

The context id is content-addressed (`ctxcache.store.context_id_for`), so identical requests
meet at one id: a stored manifest answers READY at once, a queued or running job is joined,
and only the request that creates the job (and wins the registry's build claim) builds.
Progress (Job.progress) follows the build: the cancel hooks (ctxcache/cancel.py) count the
prefill's transformer blocks and the method's layers, so a client's bar moves through the
prefill instead of sitting at 10%. Every build can be cancelled and has a time bound.

Cost: a build's clustering work (SparseMethod.build_work) is checked against the server's
limit before it is queued. Fairness: `lanes` builder threads each run one tenant's oldest
queued build (one build per tenant at a time), and the running builds take turns to compute
(indexer/build_turns.py), so one tenant's heavy build does not hold the others' behind it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from ctxcache.artifact import FORMAT_VERSION, ContextArtifact
from ctxcache.cancel import BuildCancelled, CancellableMethod, CancelToken, building, install_hooks
from ctxcache.indexer import IndexerConfig, build_artifact, prefill_chunk, reindex
from ctxcache.indexer.build import release_build_memory
from ctxcache.methods import ParamError, make_method
from ctxcache.models.loader import LoadedModel
from ctxcache.indexer.build_turns import BuildTurns
from ctxcache.indexer.job_spec import ROLES_LABEL, PutSpec, Reindex
from ctxcache.indexer.seams import BuildBackend
from ctxcache.indexer.settings import IndexerSettings
from ctxcache.errors import InvalidArgument, ResourceExhausted, Unavailable, failure_text
from ctxcache.metrics import Metrics
from ctxcache.prompting import Prompter
from ctxcache.store import ContextMeta, CorruptArtifact, context_id_for

log = logging.getLogger("ctxcache.indexer.build_queue")


@dataclass
class Job:
    context_id: str
    spec: PutSpec
    tokens: list[int]
    source: ContextArtifact | None = None  # Rebuild: re-index these K/V, no prefill
    state: str = "building"  # building | ready | failed
    stage: float = 0.0  # 0 queued, 0.1 started, 0.9 writing, 1 done
    error: str = ""
    done: threading.Event = field(default_factory=threading.Event)
    token: CancelToken = field(default_factory=CancelToken)
    expected_blocks: int = 1  # transformer blocks the prefill runs (chunks x layers)
    n_layers: int = 1
    # the built artifact while its store write goes on (None before, and once the job is done):
    # a request waiting on this build for its own answer decodes from it instead of waiting for
    # the write (these are the bytes the store keeps); the context is READY only once written
    artifact: ContextArtifact | None = None
    built: threading.Event = field(default_factory=threading.Event)  # artifact set, or the job done

    @property
    def progress(self) -> float:
        """Queued 0; 0.1..0.9: prefill blocks run (0.6) and layers indexed (0.2), which interleave
        (a layer is indexed once its prefill ends); writing 0.9; 1."""
        if self.stage != 0.1:
            return self.stage
        t = self.token
        return 0.1 + 0.6 * min(1.0, t.blocks / self.expected_blocks) + 0.2 * min(1.0, t.layers / self.n_layers)


class BuildQueue:
    def __init__(self, lm: LoadedModel, prompter: Prompter, backend: BuildBackend,
                 settings: IndexerSettings, kv_dtype: str, metrics: Metrics) -> None:
        self.lm, self.prompter, self.backend, self.settings = lm, prompter, backend, settings
        self.kv_dtype, self.metrics = kv_dtype, metrics
        self.max_tokens = settings.max_context_tokens or max(1, lm.args.max_seq_len - 256)
        self.max_tokens_why = f"model maximum {lm.args.max_seq_len}"
        install_hooks(lm.model)  # prefill checks the building thread's cancel token per block
        self._jobs: dict[str, Job] = {}
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._pending: list[Job] = []  # queued, oldest first
        self._busy: set[str] = set()  # tenants with a build on a lane
        self._turns = BuildTurns()
        default = make_method(settings.method, settings.method_params)
        self._default = (default.name, default.params)
        self._closed = threading.Event()
        self._threads = [threading.Thread(target=self._loop, name=f"ctxcache-indexer-{i}", daemon=True)
                         for i in range(settings.build_lanes)]
        for t in self._threads:
            t.start()
        self._heartbeat = threading.Thread(target=self._renew_claims, name="ctxcache-claims", daemon=True)
        self._heartbeat.start()

    def _renew_claims(self) -> None:
        """Keep the registry claims of queued and running builds alive (short leases, so a
        crashed worker's claims lapse quickly); a failed renewal is retried next beat."""
        lease = self.settings.claim_lease_s
        while not self._closed.wait(lease / 3):
            with self._lock:
                building = [cid for cid, j in self._jobs.items() if j.state == "building"]
            for cid in building:
                self.backend.renew_claim(cid, lease)

    def context_id(self, spec: PutSpec, tokens: list[int]) -> str:
        return context_id_for(self.lm.model_id, self.prompter.tokenizer_id, self.prompter.template_id,
                              self.kv_dtype, FORMAT_VERSION, spec.method, spec.method_params, tokens,
                              spec.tenant, spec.kv_codec)

    def tokens(self, spec: PutSpec) -> list[int]:
        tokens = self.prompter.context_tokens(spec.messages)
        if len(tokens) > self.max_tokens:
            raise InvalidArgument("content", f"{len(tokens)} tokens; this server caches at most "
                                  f"{self.max_tokens} ({self.max_tokens_why})")
        return tokens

    def submit(self, spec: PutSpec, tokens: list[int] | None = None,
               source: Reindex | None = None) -> tuple[str, Job | None, bool]:
        """-> (context id, the job if one is building, created). READY contexts have no job.

        tokens: skip tokenization (Rebuild); source: re-index its K/V (loaded) instead of prefilling."""
        if source is not None and source.artifact is None:
            raise ValueError(f"Reindex of {source.context_id[:12]}... without its artifact")
        method, tokens = self.admitted(spec, tokens)
        cid = self.context_id(spec, tokens)
        with self._lock:
            job = self._jobs.get(cid)
            if job is not None and job.state == "building":
                self.metrics.put_requests.labels("joined").inc()
                return cid, job, False
            if self.backend.existing(cid) is not None:  # a fleet's DAMAGED context is built again
                self.metrics.put_requests.labels("existing").inc()
                return cid, None, False
            if len(self._pending) >= self.settings.queue_limit:
                self.metrics.rejected.labels("PutContext").inc()
                raise ResourceExhausted(f"{len(self._pending)} builds queued; retry later")
            if not self.backend.claim_build(cid, self.settings.claim_lease_s):
                elsewhere = self.backend.ready_elsewhere(cid)
                if elsewhere is None:  # a live claim: the other build ends (or lapses) within a lease
                    raise Unavailable(f"context {cid} is being built by another worker; retry later")
                # READY on another worker: this worker builds its own copy (each serves its own store)
                log.info("context %s is READY at %s; building a local copy", cid[:12], elsewhere)
            chunks = 0 if source is not None else -(-len(tokens) // self._prefill_chunk())
            job = self._jobs[cid] = Job(cid, spec, tokens, source.artifact if source is not None else None,
                                        token=CancelToken(self.settings.build_timeout_s),
                                        expected_blocks=max(1, chunks * self.lm.args.n_layers),
                                        n_layers=self.lm.args.n_layers)
            self._pending.append(job)
            self._wake.notify()
        self.metrics.put_requests.labels("created").inc()
        return cid, job, True

    def admitted(self, spec: PutSpec, tokens: list[int] | None):
        """-> (method, tokens) of a Put this server accepts: valid parameters for the model, and a
        build cost within --max-build-work unless it is the operator's own method."""
        try:
            method = make_method(spec.method, spec.method_params)
            method.check_model(self.lm.args.head_dim)
        except ParamError as exc:
            raise InvalidArgument(f"method.params.{exc.field}", str(exc)) from exc
        tokens = self.tokens(spec) if tokens is None else tokens
        if (method.name, method.params) != self._default:
            self._check_work(method, len(tokens))
        return method, tokens

    def _prefill_chunk(self) -> int:
        return self.settings.chunk or prefill_chunk(self.lm.model.lm_head.weight.is_cuda)

    def _check_work(self, method, n_tokens: int) -> None:
        a, limit = self.lm.args, self.settings.max_build_work
        work = a.n_layers * method.build_work(n_tokens, a.n_heads, a.n_kv_heads)
        if work > limit:
            raise InvalidArgument("method.params", f"this build's clustering work, {work:.3g} point-centroid "
                                  f"distances for {n_tokens} tokens, exceeds this server's limit of {limit:.3g} "
                                  "(ctxcache serve --max-build-work); fewer centroids, subspaces, queries or "
                                  "k-means iterations fit")

    def cancel(self, cid: str, reason: str = "cancelled", wait_s: float = 2.0) -> bool:
        """Cancel a queued or running build of cid; -> whether one was building. Waits up to
        wait_s for the builder to stop, so a delete that follows does not race its write."""
        with self._lock:
            job = self._jobs.get(cid)
            if job is None or job.state != "building":
                return False
            job.token.cancel(reason)
        job.done.wait(wait_s)
        return True

    def tenant_of(self, cid: str) -> str | None:
        """The tenant of a stored or building context (a damaged manifest: its DAMAGED mark's); None if neither."""
        try:
            m = self.backend.manifest(cid)
        except CorruptArtifact:
            return None if (f := self.backend.damaged_facts(cid)) is None else f.tenant
        if m is not None:
            return m.tenant
        job = self.job(cid)
        return None if job is None else job.spec.tenant

    def job(self, cid: str) -> Job | None:
        with self._lock:
            return self._jobs.get(cid)

    def jobs(self) -> list[Job]:
        """A snapshot of this worker's builds (building, ready, failed), for listings."""
        with self._lock:
            return list(self._jobs.values())

    def counts(self) -> tuple[int, int]:
        """-> (building, failed) jobs."""
        with self._lock:
            states = [j.state for j in self._jobs.values()]
        return states.count("building"), states.count("failed")

    def queued(self) -> int:
        with self._lock:
            return len(self._pending)

    def _take(self) -> Job | None:
        """The oldest queued build of a tenant with none on a lane; once closed, any queued build
        (it stops at its first check, so its waiting PutContexts are answered); then None."""
        with self._lock:
            while True:
                closed = self._closed.is_set()
                job = next((j for j in self._pending if closed or j.spec.tenant not in self._busy), None)
                if job is not None:
                    self._pending.remove(job)
                    self._busy.add(job.spec.tenant)
                    return job
                if closed:
                    return None
                self._wake.wait()

    def _loop(self) -> None:
        while (job := self._take()) is not None:
            try:
                with self._turns.turn(lambda: job.token.cancelled) as checkpoint:
                    job.token.on_check = checkpoint
                    self._run_build(job)
            finally:
                with self._lock:
                    self._busy.discard(job.spec.tenant)
                    self._wake.notify_all()

    def _build(self, job: Job) -> None:
        t0, writer = time.perf_counter(), None
        try:
            job.token.check()  # cancelled while queued
            job.stage = 0.1
            method = CancellableMethod(make_method(job.spec.method, job.spec.method_params), job.token)
            labels = {**job.spec.labels, ROLES_LABEL: ",".join(job.spec.roles)}
            meta = ContextMeta(labels=labels, ttl_s=job.spec.ttl_s, pinned=job.spec.pin,
                               tenant=job.spec.tenant, prompt_hash=job.context_id)
            with building(job.token):
                if job.source is not None:
                    art = reindex(job.source, method)
                else:
                    keep = self.settings.store_queries if job.spec.keep_queries else 0
                    # each layer goes to the store as it is built: its upload overlaps the next
                    writer = self.backend.writer(job.context_id, meta)
                    art = build_artifact(self.lm, job.tokens, method,
                                         IndexerConfig(self._prefill_chunk(), self.kv_dtype, job.spec.kv_codec,
                                                       progress=False, store_queries=keep, coded_kv=True), writer)
            release_build_memory(self.lm)
            job.token.check()  # a delete that arrived during the last layer wins over the write
            job.stage, t_built = 0.9, time.perf_counter()
            job.artifact = art
            job.built.set()
            manifest = self.backend.put(job.context_id, art, meta, writer)
            job.state, job.stage = "ready", 1.0
            self.metrics.builds.labels("ready").inc()
            done = time.perf_counter()
            # the split tells a slow PutContext's build (prefill, index, host copies) from what of
            # its write was left once the build ended
            log.info("built %s: %d tokens in %.2fs (build %.2fs, store write after it %.2fs), %d bytes",
                     job.context_id[:12], len(job.tokens), done - t0, t_built - t0, done - t_built,
                     manifest.stored_bytes)
        except BaseException:
            if writer is not None:
                writer.abort()  # its uploaded chunks go; nothing was registered
            raise

    def _run_build(self, job: Job) -> None:
        t0 = time.perf_counter()
        try:
            self._build(job)
        except BuildCancelled as exc:
            job.state, job.error = "failed", f"cancelled: {exc}"
            self.metrics.builds.labels("cancelled").inc()
            self.backend.build_failed(job.context_id, job.error)
            log.info("build %s cancelled after %.1fs: %s", job.context_id[:12], time.perf_counter() - t0, exc)
        except Exception as exc:  # noqa: BLE001 - a failed build is a state, not a crash
            # the error is shown to the context's tenant: the failing part, not its address
            job.state, job.error = "failed", failure_text(exc)
            self.metrics.builds.labels("failed").inc()
            self.backend.build_failed(job.context_id, job.error)
            log.warning("build %s failed: %s: %s", job.context_id[:12], type(exc).__name__, exc)
        finally:
            self.metrics.build_seconds.observe(time.perf_counter() - t0)
            job.artifact = None  # a failed job stays listed: it must not hold the artifact
            job.built.set()
            job.done.set()
            with self._lock:
                if job.state == "ready" or job.token.cancelled:  # a cancelled id is free to build again
                    self._jobs.pop(job.context_id, None)

    def close(self, timeout: float = 5.0) -> None:
        """Cancel queued and running builds, then stop the builder (a drain ends here)."""
        with self._lock:
            self._closed.set()
            jobs = [j for j in self._jobs.values() if j.state == "building"]
            self._wake.notify_all()
        for job in jobs:
            job.token.cancel("the server is shutting down")
        end = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, end - time.monotonic()))
