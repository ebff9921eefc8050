"""The read path's helpers of TieredStore (no torch): one load per key, and what this worker
knows of the object store (is it answering; does it still hold a context this worker caches)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from ctxcache.store.object import object_layout as lay
from ctxcache.store.errors import StoreUnavailable
from ctxcache.store.tiers import ObjectTier

log = logging.getLogger("ctxcache.store.tiered")
K = TypeVar("K")


@dataclass(frozen=True)
class TieredConfig:
    check_shared_on_hit: bool = True  # a local hit asks the object store whether it still has it
    hit_check_timeout_s: float = 0.5  # ... and serves the local copy if no answer comes by then
    retry_after_s: float = 5.0  # after the object store failed, local hits skip the check this long
    # a positive check holds this long: a Delete elsewhere is seen within it, and a context read
    # often costs the object store one request per this interval
    confirm_ttl_s: float = 1.0

    def __post_init__(self) -> None:
        if not (self.hit_check_timeout_s > 0 and self.retry_after_s >= 0 and self.confirm_ttl_s >= 0):
            raise ValueError(f"hit_check_timeout_s={self.hit_check_timeout_s} must be > 0, retry_after_s="
                             f"{self.retry_after_s} and confirm_ttl_s={self.confirm_ttl_s} >= 0")


class _Flight:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None


class SingleFlight(Generic[K]):
    """run(key, fn): concurrent callers with one key share one call of fn (its value or error)."""

    def __init__(self) -> None:
        self._flights: dict[K, _Flight] = {}
        self._lock = threading.Lock()

    def run(self, key: K, fn: Callable[[], Any]) -> tuple[Any, bool]:
        """-> (value, whether this caller joined another's call)."""
        with self._lock:
            flight = self._flights.get(key)
            leader = flight is None
            if leader:
                flight = self._flights[key] = _Flight()
        if not leader:
            flight.done.wait()
            if flight.error is not None:
                raise flight.error
            return flight.value, True
        try:
            flight.value = fn()
            return flight.value, False
        except BaseException as exc:
            flight.error = exc
            raise
        finally:
            with self._lock:
                self._flights.pop(key, None)
            flight.done.set()


class Presence:
    """Whether the object store still has a context this worker caches: one HEAD, trusted for
    confirm_ttl_s; no answer within hit_check_timeout_s marks the store down for retry_after_s,
    during which local copies are served without asking."""

    def __init__(self, tier: ObjectTier, config: TieredConfig, clock: Callable[[], float]) -> None:
        self.tier, self.config, self._clock = tier, config, clock
        self._down_until = float("-inf")
        self._confirmed: dict[str, float] = {}  # context id -> when the object store last had it
        self.side = ThreadPoolExecutor(2, "ctxtier")  # checks and access marks, off the load path

    @property
    def down(self) -> bool:
        return self._clock() < self._down_until

    def mark_down(self) -> None:
        self._down_until = self._clock() + self.config.retry_after_s

    def confirm(self, context_id: str) -> None:
        self._confirmed[context_id] = self._clock()

    def forget(self, context_id: str) -> None:
        self._confirmed.pop(context_id, None)

    def still_there(self, context_id: str) -> bool:
        """False only when the object store answers that the context is gone."""
        cfg, now = self.config, self._clock()
        if not cfg.check_shared_on_hit or self.down \
                or now - self._confirmed.get(context_id, float("-inf")) < cfg.confirm_ttl_s:
            return True
        fut = self.side.submit(self.tier.contains, lay.manifest_key(context_id))
        try:
            there = bool(fut.result(timeout=cfg.hit_check_timeout_s))
        except (StoreUnavailable, FutureTimeout) as exc:
            self.mark_down()
            log.warning("object store did not answer (%s); serving local copies for %.0f s",
                        exc or "timeout", cfg.retry_after_s)
            return True
        (self.confirm if there else self.forget)(context_id)
        return there

    def close(self) -> None:
        self.side.shutdown(wait=False, cancel_futures=True)
