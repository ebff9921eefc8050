"""Build jobs on a Redis stream read by one consumer group of indexers (no torch).

A decoder appends a job (XADD, in fleet_registry's claim script, so claim and job are one
step); an indexer takes it (XREADGROUP), keeps its pending entry fresh while it builds (XCLAIM
JUSTID with idle 0 resets the entry's idle time) and acknowledges it once the artifact is in
the object store (XACK, then XDEL: a finished job leaves nothing behind). An entry idle past
the lease belongs to a dead indexer: the next `take` of any indexer claims it (XAUTOCLAIM).
"""

from __future__ import annotations

import array
from dataclasses import dataclass

import redis

from ctxcache.store.keys import check_id, prefix
from ctxcache.store.registries.redis_registry import RedisConfig, client_for, guard

STREAM = prefix("jobs") + "build"  # ctxcache:v1:jobs:build
GROUP = "indexers"


def pack_tokens(tokens: list[int]) -> bytes:
    return array.array("i", tokens).tobytes()


def unpack_tokens(raw: bytes) -> list[int]:
    a = array.array("i")
    a.frombytes(raw)
    return a.tolist()


@dataclass(frozen=True)
class TakenJob:
    entry_id: str  # the stream entry (what ack and keep_alive name)
    context_id: str
    job_id: str  # the claim token of this build: fleet_registry checks it on every update
    tokens: list[int]
    deliveries: int  # 1 on first delivery; more when taken over from a dead indexer


class JobStream:
    """One indexer's view of the build stream. `block_s`: how long `take` waits for a job."""

    def __init__(self, config: RedisConfig, consumer: str, lease_s: float, block_s: float = 0.5) -> None:
        if not lease_s > 0 or not block_s > 0:
            raise ValueError(f"lease_s={lease_s} and block_s={block_s} must be > 0")
        self.config, self.consumer = config, consumer
        self.lease_ms, self.block_ms = max(1, int(lease_s * 1000)), max(1, int(block_s * 1000))
        self._r = client_for(config, decode=False)
        self._blocking = client_for(config, block_s + config.socket_timeout_s + 1.0, decode=False)  # waits block_s
        self._group_ready = False

    @guard
    def _ensure_group(self) -> None:
        if self._group_ready:
            return
        try:
            self._r.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._group_ready = True

    @guard
    def take(self) -> TakenJob | None:
        """A dead indexer's job (idle past the lease) first, else a new one; None after block_s."""
        self._ensure_group()
        try:
            entries = self._claim_dead() or self._read_new()
        except redis.ResponseError as exc:  # Redis restarted empty: the group went with it
            if "NOGROUP" not in str(exc):
                raise
            self._group_ready = False
            return None
        if not entries:
            return None
        entry_id, fields = entries[0]
        entry_id = entry_id.decode()
        return TakenJob(entry_id, check_id(fields[b"context_id"].decode()), fields[b"job_id"].decode(),
                        unpack_tokens(fields[b"tokens"]), self._deliveries(entry_id))

    def _claim_dead(self) -> list:
        _, claimed, *_ = self._r.xautoclaim(STREAM, GROUP, self.consumer, self.lease_ms, "0-0", count=1)
        return [e for e in claimed if e and e[1]]  # entries deleted meanwhile come back empty

    def _read_new(self) -> list:
        got = self._blocking.xreadgroup(GROUP, self.consumer, {STREAM: ">"}, count=1, block=self.block_ms)
        return got[0][1] if got else []

    def _deliveries(self, entry_id: str) -> int:
        info = self._r.xpending_range(STREAM, GROUP, min=entry_id, max=entry_id, count=1)
        return int(info[0]["times_delivered"]) if info else 1

    @guard
    def keep_alive(self, entry_id: str) -> bool:
        """Reset the entry's idle time (call well within the lease while building); False if
        another indexer has taken it over (this one was presumed dead)."""
        owner = self._r.xpending_range(STREAM, GROUP, min=entry_id, max=entry_id, count=1)
        if not owner or owner[0]["consumer"].decode() != self.consumer:
            return False
        self._r.xclaim(STREAM, GROUP, self.consumer, 0, [entry_id], justid=True)
        return True

    @guard
    def release(self, entry_id: str) -> None:
        """Hand a job back (this indexer stops): its entry looks idle for a whole lease, so the
        next `take` of any indexer claims it now."""
        self._r.xclaim(STREAM, GROUP, self.consumer, 0, [entry_id], idle=self.lease_ms, justid=True)

    @guard
    def ack(self, entry_id: str) -> None:
        pipe = self._r.pipeline(transaction=True)
        pipe.xack(STREAM, GROUP, entry_id)
        pipe.xdel(STREAM, entry_id)
        pipe.execute()

    @guard
    def pending(self) -> int:
        """Jobs taken and not yet acknowledged, by any indexer."""
        return int(self._on_group(lambda: self._r.xpending(STREAM, GROUP))["pending"])

    @guard
    def waiting(self) -> int:
        """Jobs in the stream no indexer has taken yet."""
        groups = self._on_group(lambda: self._r.xinfo_groups(STREAM))
        lag = next((g.get("lag") for g in groups if g["name"].decode() == GROUP), None)
        return int(lag or 0)

    def _on_group(self, call):  # noqa: ANN001, ANN202
        """call() on the group, made again once if Redis lost it (restarted empty)."""
        self._ensure_group()
        try:
            return call()
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc) and "no such key" not in str(exc):
                raise
        self._group_ready = False
        self._ensure_group()
        return call()

    def close(self) -> None:
        self._r.close()
        self._blocking.close()
