"""The fleet's registry of facts in Redis (no torch): per context its state, the artifact's URI,
the job building it and the workers holding it hot; the build claim; delete events.

Keys (typed, versioned; <w> is a worker's host:port):
  ctxcache:v1:ctx:<id>    hash     state (BUILDING | READY | FAILED | DAMAGED | DELETED), job_id, uri,
                                   tenant, spec, n_tokens, progress, error, indexer, attempts
  ctxcache:v1:claim:<id>  string   the one build of <id> (SET NX PX, value: its job id)
  ctxcache:v1:hot:<id>    set      workers holding <id> in memory (routing: the documented key)
  ctxcache:v1:worker:<w>  string   a worker's heartbeat (PX); a hot member without one is gone
  ctxcache:v1:damaged     set      ids marked DAMAGED (a member whose entry moved on is dropped when read)
  ctxcache:v1:events      channel  "deleted <id>": workers drop their local copies
  ctxcache:v1:due:<task>  string   the last run of a periodic fleet task (ms, Redis's clock)
  ctxcache:v1:lead:<task> string   the worker running a one-at-a-time fleet task (PX)
  ctxcache:v1:reconciled  string   set by a reconcile; missing: Redis came back empty, reconcile again

Every transition is one Lua script keyed by the job id, so a build whose context was deleted
(or superseded by a newer job of the same id) learns it at its next progress update and never
marks it READY again; a DELETED entry is a tombstone that expires after `tombstone_s`.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum

import redis

from ctxcache.store.keys import check_id, prefix
from ctxcache.store.registries.redis_registry import RedisConfig, client_for, guard
from ctxcache.store.registries.fleet_scripts import (DAMAGE, DELETE, DROP_READY, DUE, ENQUEUE, FINISH, JOB_IDS, LOST,
                                          PROGRESS, RECORD, START)
from ctxcache.store.registries.job_stream import STREAM, pack_tokens

log = logging.getLogger("ctxcache.store.fleet")
EVENTS = prefix("events").rstrip(":")  # ctxcache:v1:events
DAMAGED = prefix("damaged").rstrip(":")  # ctxcache:v1:damaged
_WORKER = re.compile(r"[A-Za-z0-9_.\-:\[\]]{1,200}")


class FleetState(str, Enum):
    BUILDING = "BUILDING"
    READY = "READY"
    FAILED = "FAILED"
    DAMAGED = "DAMAGED"  # a stored object failed its check: a Put of its text rebuilds it
    DELETED = "DELETED"


class Enqueued(str, Enum):
    QUEUED = "QUEUED"  # this caller's job is on the stream
    BUILDING = "BUILDING"  # another caller's job builds it: join


def ctx_key(cid: str) -> str:
    return prefix("ctx") + check_id(cid)


def claim_key(cid: str) -> str:
    return prefix("claim") + check_id(cid)


def hot_key(cid: str) -> str:
    return prefix("hot") + check_id(cid)


def worker_key(worker: str) -> str:
    if not _WORKER.fullmatch(worker):
        raise ValueError(f"worker={worker!r} must be 1-200 characters of host:port")
    return prefix("worker") + worker


@dataclass(frozen=True)
class Facts:
    context_id: str
    state: FleetState
    job_id: str = ""
    uri: str = ""  # the artifact in the object store (READY)
    tenant: str = ""
    spec: str = ""  # the build's PutSpec as JSON (indexer/job_spec.py), for GetContext while BUILDING
    n_tokens: int = 0
    progress: float = 0.0
    error: str = ""
    indexer: str = ""  # the worker building it
    attempts: int = 0  # indexers that started it (more than 1: one died)
    updated_at: float = 0.0  # its last transition (a conditional drop names it)


class FleetRegistry:
    def __init__(self, config: RedisConfig, tombstone_s: float = 86400.0,
                 clock: Callable[[], float] = time.time) -> None:
        if not tombstone_s > 0:
            raise ValueError(f"tombstone_s={tombstone_s} must be > 0")
        self.config, self.tombstone_ms, self.clock = config, int(tombstone_s * 1000), clock
        self._r = client_for(config)
        self._scripts = {name: self._r.register_script(src) for name, src in (
            ("enqueue", ENQUEUE), ("start", START), ("progress", PROGRESS), ("finish", FINISH),
            ("delete", DELETE), ("record", RECORD), ("lost", LOST), ("drop_ready", DROP_READY), ("due", DUE),
            ("job_ids", JOB_IDS), ("damage", DAMAGE))}
        self._closed = threading.Event()

    @guard
    def ping(self) -> bool:
        return bool(self._r.ping())

    @guard
    def facts(self, cid: str) -> Facts | None:
        return _facts(cid, self._r.hgetall(ctx_key(cid)))

    # ---- builds (decoders enqueue, indexers update) ----------------------------------------------
    @guard
    def enqueue(self, cid: str, tokens: list[int], spec: str, tenant: str, claim_s: float) -> tuple[Enqueued, str]:
        """One build per id: the caller that wins the claim puts its job on the stream (one
        script: a claim without a job cannot be left behind). Call it only for an id whose
        artifact the object store lacks. -> (outcome, job id if QUEUED)."""
        job_id = uuid.uuid4().hex
        out = self._scripts["enqueue"](
            keys=[ctx_key(cid), claim_key(cid), STREAM],
            args=[job_id, _ms(claim_s), spec, tenant, len(tokens), self.clock(), cid, pack_tokens(tokens)])
        return Enqueued(out), job_id if out == Enqueued.QUEUED else ""

    @guard
    def start(self, cid: str, job_id: str, indexer: str, claim_s: float) -> int:
        """An indexer starts job_id; -> how many indexers have started it, 0 if the job is
        no longer wanted (READY already, deleted, or superseded)."""
        return int(self._scripts["start"](keys=[ctx_key(cid), claim_key(cid)],
                                          args=[job_id, indexer, _ms(claim_s), self.clock()]))

    @guard
    def progress(self, cid: str, job_id: str, progress: float, claim_s: float) -> bool:
        """Publish progress and keep the claim; False: cancelled (deleted or superseded)."""
        return bool(self._scripts["progress"](keys=[ctx_key(cid), claim_key(cid)],
                                              args=[job_id, f"{progress:.4f}", _ms(claim_s), self.clock()]))

    @guard
    def finish(self, cid: str, job_id: str, uri: str) -> bool:
        """READY at uri; False if the job was cancelled meanwhile (the caller deletes its artifact)."""
        return self._finish(cid, job_id, FleetState.READY, uri, "", 1.0)

    @guard
    def fail(self, cid: str, job_id: str, error: str) -> bool:
        return self._finish(cid, job_id, FleetState.FAILED, "", error[:500], 0.0)

    def _finish(self, cid: str, job_id: str, state: FleetState, uri: str, error: str, progress: float) -> bool:
        return bool(self._scripts["finish"](keys=[ctx_key(cid), claim_key(cid)],
                                            args=[job_id, state.value, uri, error, progress, self.clock()]))

    @guard
    def delete(self, cid: str) -> FleetState | None:
        """Tombstone cid (a running build stops at its next update), drop its claim and hot set,
        and tell every worker; -> the state it had."""
        prev = self._scripts["delete"](keys=[ctx_key(cid), claim_key(cid), hot_key(cid)],
                                       args=[self.tombstone_ms, self.clock(), EVENTS, cid])
        return FleetState(prev) if prev else None

    # ---- damage ----------------------------------------------------------------------------------
    @guard
    def mark_damaged(self, cid: str, error: str, tenant: str = "") -> bool:
        """DAMAGED with error, unless cid is being built again or was deleted; -> whether marked.
        tenant: recorded where the registry had no entry (Redis came back empty)."""
        return bool(self._scripts["damage"](keys=[ctx_key(cid), DAMAGED],
                                            args=[error[:500], self.clock(), tenant, cid]))

    @guard
    def damaged(self) -> list[Facts]:
        """Every DAMAGED entry, in id order (set members whose entry moved on are dropped)."""
        ids = sorted(self._r.smembers(DAMAGED))
        pipe = self._r.pipeline(transaction=False)
        for cid in ids:
            pipe.hgetall(ctx_key(cid))
        found = [_facts(cid, h) for cid, h in zip(ids, pipe.execute())]
        stale = [cid for cid, f in zip(ids, found) if f is None or f.state != FleetState.DAMAGED]
        if stale:
            self._r.srem(DAMAGED, *stale)
        return [f for f in found if f is not None and f.state == FleetState.DAMAGED]

    # ---- reconcile -------------------------------------------------------------------------------
    @guard
    def record_ready(self, cid: str, uri: str, tenant: str, n_tokens: int) -> str:
        """-> ADDED, KEPT (READY or building) or DELETED (a tombstone: the object is garbage)."""
        return self._scripts["record"](keys=[ctx_key(cid), claim_key(cid)],
                                       args=[uri, tenant, n_tokens, self.clock()])

    @guard
    def drop(self, cid: str) -> None:
        self._r.delete(ctx_key(cid), hot_key(cid))

    @guard
    def drop_ready(self, f: Facts) -> bool:
        """Drop f's READY entry (its object is gone) unless it changed since f was read."""
        return bool(self._scripts["drop_ready"](keys=[ctx_key(f.context_id), hot_key(f.context_id)],
                                                args=[repr(f.updated_at)]))

    @guard
    def fail_lost(self, f: Facts, error: str) -> bool:
        """FAILED for f's build if it is still BUILDING under f's job and nobody holds its claim."""
        return bool(self._scripts["lost"](keys=[ctx_key(f.context_id), claim_key(f.context_id)],
                                          args=[f.job_id, error[:500], self.clock()]))

    @guard
    def queued_jobs(self) -> set[str]:
        """The job ids on the build stream, waiting or taken (an entry leaves it when settled)."""
        return set(self._scripts["job_ids"](keys=[STREAM]))

    @guard
    def due(self, task: str, interval_s: float) -> bool:
        """Whether this caller runs the fleet's periodic `task` now: at most once per interval_s
        across every worker (a shared last-run time on Redis's clock)."""
        return bool(self._scripts["due"](keys=[prefix("due") + task], args=[_ms(interval_s)]))

    @guard
    def lead(self, task: str, worker: str, ttl_s: float) -> bool:
        """Take the fleet's one-at-a-time lock on `task` (it lapses after ttl_s)."""
        return bool(self._r.set(prefix("lead") + task, worker, nx=True, px=_ms(ttl_s)))

    @guard
    def mark_reconciled(self, worker: str) -> None:
        """The registry holds the object store's contexts (a reconcile just ran)."""
        self._r.set(prefix("reconciled").rstrip(":"), worker)

    @guard
    def reconciled(self) -> bool:
        """False once Redis has lost its data (restarted empty): the entries need a reconcile."""
        return bool(self._r.exists(prefix("reconciled").rstrip(":")))

    @guard
    def step_down(self, task: str, worker: str) -> None:
        key = prefix("lead") + task
        if self._r.get(key) == worker:  # another worker's lock after a lapse stays
            self._r.delete(key)

    @guard
    def entries(self) -> Iterator[Facts]:
        keys = list(self._r.scan_iter(match=prefix("ctx") + "*", count=500))
        pipe = self._r.pipeline(transaction=False)
        for k in keys:
            pipe.hgetall(k)
        found = [_facts(k[len(prefix("ctx")):], h) for k, h in zip(keys, pipe.execute())]
        return iter([f for f in found if f is not None])

    # ---- hot sets --------------------------------------------------------------------------------
    @guard
    def heartbeat(self, worker: str, ttl_s: float, add: set[str] = frozenset(),
                  remove: set[str] = frozenset()) -> None:
        """Renew worker's heartbeat and move its hot memberships by the given ids."""
        pipe = self._r.pipeline(transaction=False)
        pipe.set(worker_key(worker), "1", px=_ms(ttl_s))
        for cid in add:
            pipe.sadd(hot_key(cid), worker)
        for cid in remove:
            pipe.srem(hot_key(cid), worker)
        pipe.execute()

    @guard
    def leave(self, worker: str, hot: set[str]) -> None:
        """A worker stopping: its heartbeat and memberships go now, not at expiry."""
        pipe = self._r.pipeline(transaction=False)
        pipe.delete(worker_key(worker))
        for cid in hot:
            pipe.srem(hot_key(cid), worker)
        pipe.execute()

    @guard
    def hot_workers(self, cid: str) -> list[str]:
        """Workers holding cid in memory whose heartbeat is alive (the dead are removed)."""
        members = sorted(self._r.smembers(hot_key(cid)))
        if not members:
            return []
        alive = self._pipeline_exists([worker_key(m) for m in members])
        dead = [m for m, ok in zip(members, alive) if not ok]
        if dead:
            self._r.srem(hot_key(cid), *dead)
        return [m for m in members if m not in dead]

    def _pipeline_exists(self, keys: list[str]) -> list[int]:
        pipe = self._r.pipeline(transaction=False)
        for k in keys:
            pipe.exists(k)
        return pipe.execute()

    # ---- events ----------------------------------------------------------------------------------
    def listen(self, on_deleted: Callable[[str], None]) -> threading.Thread:
        """A daemon thread calling on_deleted(cid) for every delete in the fleet; it reconnects
        after Redis outages until close()."""
        thread = threading.Thread(target=self._listen, args=(on_deleted,), name="ctxcache-fleet-events",
                                  daemon=True)
        thread.start()
        return thread

    def _listen(self, on_deleted: Callable[[str], None]) -> None:
        while not self._closed.is_set():
            conn = client_for(self.config, socket_timeout_s=2.0)  # outlives get_message's wait
            try:
                sub = conn.pubsub(ignore_subscribe_messages=True)
                sub.subscribe(EVENTS)
                while not self._closed.is_set():
                    msg = sub.get_message(timeout=0.5)
                    if msg and isinstance(msg.get("data"), str) and msg["data"].startswith("deleted "):
                        _call(on_deleted, msg["data"].split(" ", 1)[1])
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError):
                self._closed.wait(0.5)  # Redis down: each Generate checks the registry anyway
            finally:
                conn.close()

    def close(self) -> None:
        self._closed.set()
        self._r.close()


def _call(fn: Callable[[str], None], cid: str) -> None:
    try:
        fn(cid)
    except Exception:  # noqa: BLE001 - one bad drop must not end the listener
        log.exception("fleet event for %s failed", cid[:12])


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


def _facts(cid: str, h: dict[str, str]) -> Facts | None:
    if not h or "state" not in h:
        return None
    return Facts(cid, FleetState(h["state"]), h.get("job_id", ""), h.get("uri", ""), h.get("tenant", ""),
                 h.get("spec", ""), int(h.get("n_tokens", 0) or 0), float(h.get("progress", 0) or 0),
                 h.get("error", ""), h.get("indexer", ""), int(h.get("attempts", 0) or 0),
                 float(h.get("updated_at", 0) or 0))
