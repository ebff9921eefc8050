"""Counters of artifact loads per tier (thread-safe, no prometheus here: the service exports
`snapshot()`; see ctxcache/metrics.py). Tiers counted by the store: `local` (LMDB on this
machine) and `object` (the shared object store); the service counts DRAM and HBM itself."""

from __future__ import annotations

import threading
from dataclasses import dataclass

TIERS = ("local", "object")


@dataclass(frozen=True)
class TierLoads:
    hits: int = 0  # loads this tier answered
    bytes: int = 0  # stored bytes those loads read
    seconds: float = 0.0  # wall time of those loads (to a usable artifact)

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class LoadSnapshot:
    tiers: dict[str, TierLoads]
    misses: int  # loads no tier could answer (absent, expired or deleted)
    unavailable: int  # loads that needed the object store and it did not answer
    corrupt: int  # loads refused because an object failed its checksum or size
    shared_downloads: int  # loads that joined another caller's download of the same context


class LoadStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tiers = {t: TierLoads() for t in TIERS}
        self._counts = {"misses": 0, "unavailable": 0, "corrupt": 0, "shared_downloads": 0}

    def hit(self, tier: str, nbytes: int, seconds: float) -> None:
        with self._lock:
            t = self._tiers[tier]
            self._tiers[tier] = TierLoads(t.hits + 1, t.bytes + nbytes, t.seconds + seconds)

    def count(self, what: str) -> None:
        with self._lock:
            self._counts[what] += 1

    def snapshot(self) -> LoadSnapshot:
        with self._lock:
            return LoadSnapshot(dict(self._tiers), **self._counts)
