"""A decoder's presence in the fleet: its heartbeat with the contexts it holds hot, and the
delete events that make it drop its copies.

Every `interval_s` the worker renews its heartbeat (TTL 3 x interval) and moves its hot
memberships by what entered or left its DRAM cache since the last beat; a worker that dies
stops beating and drops out of every hot set within the TTL. A delete anywhere evicts the
context here from DRAM, the device and the local store (a Generate that races the event is
NOT_FOUND anyway: every lookup asks the registry first, service/fleet_backend.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Protocol

from ctxcache.store import RegistryUnavailable
from ctxcache.store.registries.fleet_registry import FleetRegistry

log = logging.getLogger("ctxcache.service.fleet")


class PresenceBackend(Protocol):
    """What Presence uses of the service's FleetBackend (service/fleet_backend.py)."""

    fleet: FleetRegistry

    def drop_local(self, cid: str) -> bool: ...


class Presence:
    def __init__(self, backend: PresenceBackend, worker: str, hot: Callable[[], set[str]],
                 evict: Callable[[str], object], interval_s: float) -> None:
        if not interval_s > 0:
            raise ValueError(f"heartbeat interval_s={interval_s} must be > 0")
        self.backend, self.fleet, self.worker = backend, backend.fleet, worker
        self.hot, self.evict, self.interval_s = hot, evict, interval_s
        self._published: set[str] = set()
        self._resync = False
        self._closed = threading.Event()
        self.fleet.listen(self._deleted)
        self._thread = threading.Thread(target=self._beat_loop, name="ctxcache-fleet-heartbeat", daemon=True)
        self._thread.start()

    def _deleted(self, cid: str) -> None:
        self.evict(cid)
        self.backend.drop_local(cid)
        self._published.discard(cid)

    def _beat_loop(self) -> None:
        while True:
            self.beat()
            if self._closed.wait(self.interval_s):
                return

    def beat(self) -> None:
        now = self.hot()
        add = now if self._resync else now - self._published  # Redis may have lost them meanwhile
        try:
            self.fleet.heartbeat(self.worker, 3 * self.interval_s, add, self._published - now)
            self._published, self._resync = now, False
        except RegistryUnavailable as exc:  # the heartbeat lapses; the first beat after Redis is back
            log.debug("heartbeat skipped: %s", exc)  # publishes every hot id again
            self._resync = True

    def close(self) -> None:
        self._closed.set()
        self._thread.join(5)
        try:
            self.fleet.leave(self.worker, self._published)
        except RegistryUnavailable:
            pass
