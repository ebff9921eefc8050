"""DRAM cache of loaded artifacts: LRU by bytes, one load per id at a time.

A stream acquires an artifact and keeps the Python reference for its whole life, so evicting
(or deleting) an id only drops the cache's reference: running streams finish on the complete
artifact they hold, new ones reload or get NOT_FOUND. No torch or gRPC here.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Loaded(Generic[T]):
    value: T
    hit: bool
    load_seconds: float


class _Flight:
    """One in-progress load that concurrent acquirers of the same id wait for."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None


class ArtifactCache(Generic[T]):
    def __init__(self, capacity_bytes: int, load: Callable[[str], T], size_of: Callable[[T], int]) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes={capacity_bytes} must be >= 0")
        self.capacity, self._load, self._size_of = capacity_bytes, load, size_of
        self._items: OrderedDict[str, tuple[T, int]] = OrderedDict()
        self._flights: dict[str, _Flight] = {}
        self._epoch: dict[str, int] = {}  # bumped by evict, so a load racing an evict is not cached
        self._lock = threading.Lock()
        self.bytes = 0

    def acquire(self, key: str) -> Loaded[T]:
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return Loaded(self._items[key][0], True, 0.0)
            flight = self._flights.get(key)
            leader = flight is None
            if leader:
                flight = self._flights[key] = _Flight()
                epoch = self._epoch.get(key, 0)
        if not leader:
            flight.done.wait()
            if flight.error is not None:
                raise flight.error
            return Loaded(flight.value, True, 0.0)
        return self._lead(key, flight, epoch)

    def _lead(self, key: str, flight: _Flight, epoch: int) -> Loaded[T]:
        t0 = time.perf_counter()
        try:
            flight.value = self._load(key)
        except BaseException as exc:
            flight.error = exc
            raise
        finally:
            with self._lock:
                if self._flights.get(key) is flight:
                    del self._flights[key]
                if flight.error is None and self._epoch.get(key, 0) == epoch:
                    self._insert(key, flight.value)
            flight.done.set()
        return Loaded(flight.value, False, time.perf_counter() - t0)

    def offer(self, key: str, value: T, still_valid: Callable[[], bool]) -> bool:
        """Hold a value made outside a load (a build's artifact once stored) unless the key is
        held or loading, or still_valid() says no, or an evict came after that check; -> held."""
        with self._lock:
            if key in self._items or key in self._flights:
                return False
            epoch = self._epoch.get(key, 0)
        if not still_valid():  # (an evict follows its store delete: one after this bumps the epoch)
            return False
        with self._lock:
            if key in self._items or key in self._flights or self._epoch.get(key, 0) != epoch:
                return False
            self._insert(key, value)
            return key in self._items

    def _insert(self, key: str, value: T) -> None:
        size = self._size_of(value)
        if size > self.capacity:
            return  # serve it uncached rather than flush everything for one artifact
        while self._items and self.bytes + size > self.capacity:
            _, (_, old) = self._items.popitem(last=False)
            self.bytes -= old
        self._items[key] = (value, size)
        self.bytes += size

    def evict(self, key: str) -> int:
        """Drop key from DRAM; -> bytes freed. Streams holding it are unaffected."""
        with self._lock:
            self._epoch[key] = self._epoch.get(key, 0) + 1
            self._flights.pop(key, None)  # later acquirers must not join a load from before
            item = self._items.pop(key, None)
            if item is None:
                return 0
            self.bytes -= item[1]
            return item[1]

    def keys(self) -> set[str]:
        """The ids held now (what a fleet worker advertises as hot)."""
        with self._lock:
            return set(self._items)

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._items

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)
