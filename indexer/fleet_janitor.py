"""An indexer's upkeep of the shared tier: reconcile the registry at start and whenever Redis
comes back empty (its `reconciled` mark gone: checked every `check_s`), and collect the object
store's garbage every `gc_interval_s`.

Indexers do it because they write the object store and the builds' states; decoders only
read (their deletes are tombstoned first). Several indexers are safe together: the start's
reconcile runs on one of them at a time (a lock on Redis) and changes entries by conditional
scripts only; GC runs once per interval across the fleet (a last-run time on Redis's clock),
and it is safe beside live writers by age alone (store/object/object_gc.py). Contexts GC deletes for
their TTL are tombstoned in the registry, so every decoder drops its copies as on a delete.
"""

from __future__ import annotations

import logging
import threading
import time

from ctxcache.indexer.seams import FleetBuildBackend
from ctxcache.store import RegistryUnavailable, StoreError
from ctxcache.store.registries.fleet_reconcile import reconcile_fleet

log = logging.getLogger("ctxcache.service.fleet")
RECONCILE_LOCK_S = 600.0  # a reconcile that dies holding the lock frees it after this


class Janitor:
    def __init__(self, backend: FleetBuildBackend, worker: str, gc_interval_s: float, gc_grace_s: float,
                 check_s: float = 2.0) -> None:
        self.backend, self.fleet, self.worker = backend, backend.fleet, worker
        self.gc_interval_s, self.gc_grace_s, self.check_s = gc_interval_s, gc_grace_s, check_s
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ctxcache-fleet-janitor", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self._quietly("reconcile at start", self.reconcile)
        next_gc = time.monotonic() + self.gc_interval_s
        while not self._closed.wait(self.check_s):
            self._quietly("reconcile after Redis came back empty", self.reconcile_if_lost)
            if self.gc_interval_s > 0 and time.monotonic() >= next_gc:
                next_gc = time.monotonic() + self.gc_interval_s
                self._quietly("object store GC", self.collect)

    def reconcile_if_lost(self) -> None:
        """Redis restarted without its data: the entries of every stored context are gone until
        a reconcile writes them again, so one indexer does it now (no worker restart)."""
        try:
            lost = not self.fleet.reconciled()
        except RegistryUnavailable:
            return  # Redis down: checked again when it answers (the outage itself is logged elsewhere)
        if lost:
            log.warning("the registry has lost its entries (Redis came back empty): reconciling")
            self.reconcile()

    def _quietly(self, what: str, call) -> None:  # noqa: ANN001
        """A failure is logged and tried again at the next turn: the worker serves on."""
        try:
            call()
        except (RegistryUnavailable, StoreError) as exc:
            log.warning("%s skipped: %s", what, exc)
        except Exception:  # noqa: BLE001 - upkeep must not end the thread
            log.exception("%s failed", what)

    def reconcile(self) -> None:
        if not self.fleet.lead("reconcile", self.worker, RECONCILE_LOCK_S):
            log.info("reconcile: another worker is reconciling")
            return
        try:
            added, removed, damaged = reconcile_fleet(self.fleet, self.backend.store, self.backend.artifact_uri)
            self.fleet.mark_reconciled(self.worker)
        finally:
            self.fleet.step_down("reconcile", self.worker)
        log.info("reconciled the registry with the object store: %d added, %d stale removed, %d damaged (%s)",
                 added, removed, len(damaged), ", ".join(c[:12] for c in damaged) or "none")

    def collect(self) -> None:
        if not self.fleet.due("gc", self.gc_interval_s):
            return
        report = self.backend.store.gc(self.gc_grace_s)
        for cid in report.expired:
            self.fleet.delete(cid)
        log.info("object store GC: %d expired contexts, %d orphan chunks (%d bytes), %d stale marks, %d partials",
                 len(report.expired), report.orphan_chunks, report.orphan_bytes, report.stale_access,
                 report.partials)

    def close(self) -> None:
        self._closed.set()
        self._thread.join(5)
