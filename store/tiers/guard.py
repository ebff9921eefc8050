"""A deadline and a circuit breaker in front of an ObjectTier.

Why: an object store that hangs (SIGSTOPped SeaweedFS: the port open, nothing answering) held
every cold call for the SDK's request timeout times its attempts, 20 s each, and every caller
waited that again. Here a single-object call (the manifest GET that starts a cold load, a
manifest PUT, a delete) gives up after `call_s` (the worker thread is left to the SDK's own
timeout; it is a daemon), and the first failure opens the breaker: for `open_s` every call
raises StoreUnavailable at once; then one call probes, and its success closes the breaker.
Batches (a load's chunks) keep the tier's own `deadline_s` and pass the breaker only.

A request's deadline (`request_deadline`, set by the service around an RPC's blocking work)
bounds every call further: see `_budget` for how the two combine.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

from ctxcache.store.errors import StoreDeadline, StoreUnavailable
from ctxcache.store.tiers.base import ObjectInfo, ObjectTier

T = TypeVar("T")
# the answer must still reach the client: a call bound by the request's deadline ends this much
# earlier (a tenth of the time left, at most MARGIN_S), so the caller reads why, not a bare timeout
MARGIN_S = 0.25
_DEADLINE: ContextVar[float | None] = ContextVar("ctxcache_store_deadline", default=None)


@contextmanager
def request_deadline(deadline: float | None) -> Iterator[None]:
    """Object-store calls made in this block (this thread, or a context copied from it) end by
    `deadline` (time.monotonic()), None: no request deadline (the guard's own bounds alone)."""
    token = _DEADLINE.set(deadline)
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def _left() -> float | None:
    """Seconds the request has left for the store (its margin kept), None without a deadline."""
    deadline = _DEADLINE.get()
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    return left - min(MARGIN_S, max(0.0, left) / 10)


@dataclass(frozen=True)
class GuardConfig:
    call_s: float = 3.0  # one small object (a manifest): its answer, or StoreUnavailable
    open_s: float = 2.0  # after a failure, calls fail at once for this long, then one probes

    def __post_init__(self) -> None:
        for name in ("call_s", "open_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")


class Breaker:
    """closed -> (a failure) open for open_s -> one probe call -> closed, or open again."""

    def __init__(self, open_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.open_s, self._clock = open_s, clock
        self._lock = threading.Lock()
        self._open_until: float | None = None  # None: closed
        self._probing = False
        self._last = ""

    def admit(self) -> bool:
        """Whether a call may go to the store now (a half-open breaker admits one probe)."""
        with self._lock:
            if self._open_until is None:
                return True
            if self._clock() < self._open_until or self._probing:
                return False
            self._probing = True
            return True

    def succeeded(self) -> None:
        with self._lock:
            self._open_until, self._probing = None, False

    def released(self) -> None:
        """A call ended by its request's deadline: no verdict on the store (a probe may go again)."""
        with self._lock:
            self._probing = False

    def failed(self, why: str) -> None:
        with self._lock:
            self._open_until, self._probing, self._last = self._clock() + self.open_s, False, why

    def refusal(self, uri: str, op: str) -> StoreUnavailable:
        with self._lock:
            left = max(0.0, (self._open_until or 0.0) - self._clock())
            last = self._last
        return StoreUnavailable(f"object store {uri}: {op} not tried: it failed {self.open_s:g} s ago or less "
                                f"(next try in {left:.1f} s): {last}")


class GuardedTier:
    """The ObjectTier interface of `inner`, each call behind the breaker; single-object calls
    with a deadline. Anything else of the inner tier passes through unguarded."""

    def __init__(self, inner: ObjectTier, config: GuardConfig = GuardConfig(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.inner, self.guard_config = inner, config
        self.breaker = Breaker(config.open_s, clock)

    def __getattr__(self, name: str) -> Any:  # uri, config, scheme, path, ... of the inner tier
        return getattr(self.inner, name)

    # ---- single objects: a deadline ------------------------------------------------------------
    def get(self, key: str) -> bytes | None:
        return self._timed("get", key, lambda: self.inner.get(key))

    def contains(self, key: str) -> bool:
        return self._timed("contains", key, lambda: self.inner.contains(key))

    def put(self, key: str, data: bytes | memoryview) -> None:
        return self._timed("put", key, lambda: self.inner.put(key, data))

    def delete(self, key: str) -> bool:
        return self._timed("delete", key, lambda: self.inner.delete(key))

    # ---- listings and batches: the breaker only (their size sets their time) --------------------
    def list(self, prefix: str) -> list[ObjectInfo]:
        return self._guarded("list", prefix, lambda: self.inner.list(prefix))

    def folders(self, prefix: str) -> list[ObjectInfo]:
        return self._guarded("folders", prefix, lambda: self.inner.folders(prefix))

    def delete_prefix(self, prefix: str) -> None:
        return self._guarded("delete_prefix", prefix, lambda: self.inner.delete_prefix(prefix))

    def sweep_partials(self, prefix: str, older_than: float) -> int:
        return self._guarded("sweep", prefix, lambda: self.inner.sweep_partials(prefix, older_than))

    def put_many(self, items: Sequence[tuple[str, bytes | memoryview]]) -> None:
        return self._guarded("put", f"{len(items)} objects", lambda: self.inner.put_many(items))

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return self._guarded("get", f"{len(keys)} objects", lambda: self.inner.get_many(keys))

    def get_many_into(self, keys: Sequence[str], outs: Sequence[memoryview],
                      then: Callable[[int, int | None], None]) -> list[int | None]:
        return self._guarded("get", f"{len(keys)} objects", lambda: self.inner.get_many_into(keys, outs, then))

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        return self._guarded("contains", f"{len(keys)} objects", lambda: self.inner.contains_many(keys))

    def delete_many(self, keys: Sequence[str]) -> int:
        return self._guarded("delete", f"{len(keys)} objects", lambda: self.inner.delete_many(keys))

    def close(self) -> None:
        self.inner.close()

    def __repr__(self) -> str:
        return f"GuardedTier({self.inner!r})"

    # ---- the guard ------------------------------------------------------------------------------
    def _guarded(self, op: str, key: str, call: Callable[[], T]) -> T:
        """A batch: the breaker, and the request's deadline if it has one (no bound of its own)."""
        left = _left()
        return self._admitted(op, call if left is None else lambda: _within(left, call, lambda: self._late(op, key)))

    def _timed(self, op: str, key: str, call: Callable[[], T]) -> T:
        seconds, ours = self._budget()
        timeout = (lambda: self.inner.unavailable(op, key, TimeoutError(f"no answer within {seconds:g} s"))) \
            if ours else (lambda: self._late(op, key))
        return self._admitted(op, lambda: _within(seconds, call, timeout))

    def _budget(self) -> tuple[float, bool]:
        """-> (seconds a single-object call may take, whether that is the guard's own call_s).

        min(the request's time left, call_s), not the time left alone: a healthy store answers
        one small object in milliseconds, so call_s without an answer already means it hangs,
        and a request allowed a minute must not hold its thread (and the next caller, until the
        breaker opens) on a hung store for that minute. A request with less time ends its call
        when nobody waits for the answer any more; that says nothing of the store, so it raises
        StoreDeadline, which opens no breaker (a client's short deadline cannot shut the store
        off for everyone). Without a request deadline: call_s."""
        call_s, left = self.guard_config.call_s, _left()
        return (call_s, True) if left is None or left >= call_s else (left, False)

    def _late(self, op: str, key: str) -> StoreDeadline:
        return StoreDeadline(f"object store {self.inner.uri}: {op} {key}: no answer before the request's deadline")

    def _admitted(self, op: str, call: Callable[[], T]) -> T:
        if not self.breaker.admit():
            raise self.breaker.refusal(self.inner.uri, op)
        try:
            out = call()
        except StoreUnavailable as exc:
            self.breaker.failed(str(exc))
            raise
        except StoreDeadline:
            self.breaker.released()
            raise
        except BaseException:
            self.breaker.succeeded()  # it answered (a bad key, a closed tier): not an outage
            raise
        self.breaker.succeeded()
        return out


def _within(seconds: float, call: Callable[[], T], timeout: Callable[[], Exception]) -> T:
    """call() on a daemon thread; its result or exception, or timeout() after `seconds` (the
    thread is left to finish on its own: a blocked SDK call cannot be interrupted)."""
    if seconds <= 0:
        raise timeout()
    box: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["out"] = call()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box["exc"] = exc
        done.set()

    threading.Thread(target=run, name="ctxcache-tier-call", daemon=True).start()
    if not done.wait(seconds):
        raise timeout()
    if "exc" in box:
        raise box["exc"]
    return box["out"]
