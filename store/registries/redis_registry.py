"""The registry in Redis: `ctxcache:v1:prompt:<hash>` hashes and `ctxcache:v1:build:<hash>`
claims (SET NX PX). Every call fails fast with RegistryUnavailable when Redis is down: short
socket timeouts, a few retries with capped exponential backoff (worst case about
(retries + 1) * (connect + socket timeout) + retries * backoff cap; ~0.9 s by default).
"""

from __future__ import annotations

import functools
import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from ctxcache.store.keys import BuildLockKey, PromptKey, check_id, prefix
from ctxcache.store.registries.registry import CLAIM_LEASE_S, BuildState, Registry, RegistryEntry, RegistryUnavailable

F = TypeVar("F", bound=Callable[..., Any])

# Compare-and-delete: drop a claim only if this process still owns it (its lease may have
# lapsed and another builder taken over).
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
# Compare-and-extend: renew a claim's lease only while this process still owns it.
_RENEW = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"


@dataclass(frozen=True)
class RedisConfig:
    host: str = "127.0.0.1"
    port: int = 6379
    db: int = 0
    password: str | None = None
    connect_timeout_s: float = 0.2
    socket_timeout_s: float = 0.2
    retries: int = 2
    backoff_base_s: float = 0.01
    backoff_cap_s: float = 0.05

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port={self.port} must be in 1..65535")
        for name in ("connect_timeout_s", "socket_timeout_s", "backoff_base_s", "backoff_cap_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")
        if not 0 <= self.retries <= 10:
            raise ValueError(f"retries={self.retries} must be in 0..10")

    def worst_case_s(self) -> float:
        """Upper bound of one failing call (what 'fail fast' promises)."""
        per_try = self.connect_timeout_s + self.socket_timeout_s
        return (self.retries + 1) * per_try + self.retries * self.backoff_cap_s


def _guard(fn: F) -> F:
    @functools.wraps(fn)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, *args, **kwargs)
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as exc:
            raise RegistryUnavailable(f"redis at {self.config.host}:{self.config.port} is "
                                      f"unavailable: {exc}") from exc
    return wrapped  # type: ignore[return-value]


guard = _guard  # the fleet's Redis parts (job_stream, fleet_registry) fail the same way


def client_for(c: RedisConfig, socket_timeout_s: float | None = None, decode: bool = True) -> redis.Redis:
    """A client that fails as fast as the config says: its retries and backoff, not redis-py's
    defaults (3 retries from a 1 s backoff: seconds before a down Redis is reported)."""
    retry = Retry(ExponentialBackoff(cap=c.backoff_cap_s, base=c.backoff_base_s), c.retries)
    return redis.Redis(host=c.host, port=c.port, db=c.db, password=c.password, decode_responses=decode,
                       socket_timeout=c.socket_timeout_s if socket_timeout_s is None else socket_timeout_s,
                       socket_connect_timeout=c.connect_timeout_s, retry=retry,
                       retry_on_error=[redis.exceptions.ConnectionError, redis.exceptions.TimeoutError])


class RedisRegistry(Registry):
    def __init__(self, config: RedisConfig = RedisConfig()) -> None:
        self.config = c = config
        retry = Retry(ExponentialBackoff(cap=c.backoff_cap_s, base=c.backoff_base_s), c.retries)
        self._r = redis.Redis(host=c.host, port=c.port, db=c.db, password=c.password,
                              socket_timeout=c.socket_timeout_s,
                              socket_connect_timeout=c.connect_timeout_s, retry=retry,
                              retry_on_error=[redis.exceptions.ConnectionError,
                                              redis.exceptions.TimeoutError],
                              decode_responses=True)
        self._release = self._r.register_script(_RELEASE)
        self._renew = self._r.register_script(_RENEW)
        self._owner = f"{os.getpid()}:{uuid.uuid4().hex}"  # claim token of this registry

    @_guard
    def ping(self) -> bool:
        return bool(self._r.ping())

    @_guard
    def get(self, prompt_hash: str) -> RegistryEntry | None:
        return _entry(prompt_hash, self._r.hgetall(PromptKey(prompt_hash).to_string()))

    @_guard
    def put(self, entry: RegistryEntry) -> None:
        self._r.hset(PromptKey(entry.prompt_hash).to_string(), mapping=_fields(entry))

    @_guard
    def delete(self, prompt_hash: str) -> bool:
        return bool(self._r.delete(PromptKey(prompt_hash).to_string()))

    @_guard
    def entries(self) -> Iterator[RegistryEntry]:
        keys = list(self._r.scan_iter(match=prefix(PromptKey.kind) + "*", count=500))
        pipe = self._r.pipeline(transaction=False)
        for k in keys:
            pipe.hgetall(k)
        found = [(_entry(PromptKey.from_string(k).prompt_hash, v)) for k, v in
                 zip(keys, pipe.execute())]
        return iter([e for e in found if e is not None])

    @_guard
    def claim_build(self, prompt_hash: str, context_id: str, location: str = "",
                    lease_s: float = CLAIM_LEASE_S) -> bool:
        check_id(context_id)
        lock = BuildLockKey(prompt_hash).to_string()
        if not self._r.set(lock, self._owner, nx=True, px=max(1, int(lease_s * 1000))):
            return False
        cur = self.get(prompt_hash)
        if cur is not None and cur.state == BuildState.READY:
            self.release_build(prompt_hash)
            return False
        self.put(RegistryEntry(prompt_hash, context_id, BuildState.BUILDING, location, "",
                               self.clock()))
        return True

    @_guard
    def release_build(self, prompt_hash: str) -> None:
        self._release(keys=[BuildLockKey(prompt_hash).to_string()], args=[self._owner])

    @_guard
    def renew_build(self, prompt_hash: str, lease_s: float = CLAIM_LEASE_S) -> bool:
        lock = BuildLockKey(prompt_hash).to_string()
        return bool(self._renew(keys=[lock], args=[self._owner, max(1, int(lease_s * 1000))]))

    @_guard
    def build_claimed(self, prompt_hash: str) -> bool:
        return bool(self._r.exists(BuildLockKey(prompt_hash).to_string()))

    def close(self) -> None:
        self._r.close()


def _fields(e: RegistryEntry) -> dict[str, str]:
    return {"context_id": e.context_id, "state": e.state.value, "location": e.location,
            "error": e.error, "updated_at": repr(e.updated_at), "tenant": e.tenant}


def _entry(prompt_hash: str, h: dict[str, str]) -> RegistryEntry | None:
    if not h:
        return None
    return RegistryEntry(prompt_hash, h["context_id"], BuildState(h["state"]), h.get("location", ""),
                         h.get("error", ""), float(h.get("updated_at", 0.0)), h.get("tenant", ""))
