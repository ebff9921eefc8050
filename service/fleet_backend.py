"""The Backend of a fleet worker (--role indexer | decoder): the object store is the copy of
record (the worker's store reads through to it), Redis holds the facts (fleet_registry).

What changes against the single-node Backend:
- a build's claim is the job on the stream, taken by the decoder that enqueued it; the indexer
  building it records the outcome itself (indexer/fleet_indexer.py), so claim / put / failure
  here only touch the store;
- a context is readable unless the registry says DELETED: every lookup asks Redis first, so a
  DeleteContext on one decoder is NOT_FOUND on all of them at once; with Redis down the local
  tiers and the object store answer alone (a delete then needs Redis: UNAVAILABLE);
- Reconcile rebuilds the registry from the object store's listing;
- a stored object that fails its check marks the context DAMAGED in the registry (GetContext and
  ListContexts show it, reconcile skips it); a Put of its content removes the damaged objects
  and builds it again, and Delete / Evict remove it as any other.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from ctxcache.service.backend import Backend
from ctxcache.errors import Unavailable
from ctxcache.store import Manifest, RegistryUnavailable, TieredStore
from ctxcache.store.registries.fleet_reconcile import reconcile_fleet
from ctxcache.store.registries.fleet_registry import Facts, FleetRegistry, FleetState

log = logging.getLogger("ctxcache.service.fleet")
REDIS_RETRY_S = 1.0


@dataclass(frozen=True)
class FleetFacts:
    """What GetContext shows of the registry: where the artifact is and who holds it hot."""

    artifact_uri: str = ""
    hot_workers: tuple[str, ...] = ()
    damage: str = ""  # DAMAGED: which object failed its check


class FleetBackend(Backend):
    def __init__(self, store: TieredStore, fleet: FleetRegistry, role: str) -> None:
        super().__init__(store, fleet, f"redis (fleet, {role})")
        self.fleet, self.role = fleet, role
        self._redis_down_until = float("-inf")

    def relocate(self, location: str) -> None:
        """This worker's address (its name in hot sets and on the stream); the store keeps the
        object store's URI as its location."""
        self.location = location

    def artifact_uri(self, cid: str) -> str:
        return self.store.artifact_uri(cid)

    def facts(self, cid: str) -> Facts | None:
        """The registry's entry; None if it has none or Redis is down (the stores then answer:
        after a failure Redis is not asked again for REDIS_RETRY_S, so a hung Redis costs one
        request its timeouts, not every request)."""
        if time.monotonic() < self._redis_down_until:
            return None
        try:
            return self.fleet.facts(cid)
        except RegistryUnavailable as exc:
            log.warning("registry unavailable (local tiers serve alone for %.0f s): %s", REDIS_RETRY_S, exc)
            self._redis_down_until = time.monotonic() + REDIS_RETRY_S
            return None

    def fleet_facts(self, cid: str) -> FleetFacts:
        f = self.facts(cid)
        if f is not None and f.state == FleetState.DAMAGED:
            return FleetFacts(damage=f.error or "damaged")
        if f is None or f.state != FleetState.READY:
            return FleetFacts()
        try:
            hot = tuple(self.fleet.hot_workers(cid))
        except RegistryUnavailable:
            hot = ()
        return FleetFacts(f.uri, hot)

    # ---- builds: the job on the stream is the claim ---------------------------------------------
    def claim_build(self, cid: str, lease_s: float) -> bool:
        return True

    def ready_elsewhere(self, cid: str) -> str | None:
        return None

    def renew_claim(self, cid: str, lease_s: float) -> None:
        return None

    def put(self, cid: str, art, meta, writer=None) -> Manifest:  # noqa: ANN001
        return (writer or self.store.writer(cid, meta)).finish(art)

    def build_failed(self, cid: str, error: str) -> None:
        return None

    # ---- reads: DELETED in the registry wins over any copy; damage as on one node (Backend) ----
    def manifest(self, cid: str) -> Manifest | None:
        f = self.facts(cid)
        if f is not None and f.state == FleetState.DELETED:
            return None
        return super().manifest(cid)

    # ---- damage: the registry's DAMAGED state (Backend.existing / load / manifest mark it) -------
    def record_manifest(self, cid: str) -> Manifest | None:
        """The copy of record, not a local copy (trusted for a second after its last check)."""
        return self.store.shared.manifest(cid)

    def existing(self, cid: str) -> Manifest | None:
        f = self.facts(cid)
        if f is not None and f.state == FleetState.DELETED:
            return None
        return super().existing(cid)

    def damaged_facts(self, cid: str) -> Facts | None:
        f = self.facts(cid)
        return f if f is not None and f.state == FleetState.DAMAGED else None

    def _damaged(self) -> list[Facts]:
        return self.fleet.damaged()

    def _mark_damaged(self, cid: str, why: str, tenant: str) -> bool:
        return self.fleet.mark_damaged(cid, why, tenant)  # the entry keeps its tenant

    def missing(self, cid: str) -> str:
        return f"context {cid} not found"

    # ---- admin ----------------------------------------------------------------------------------
    def delete(self, cid: str) -> bool:
        """Tombstone in Redis (a running build stops, every decoder drops it), then the object
        store's copy and this worker's."""
        try:
            prev = self.fleet.delete(cid)
        except RegistryUnavailable as exc:
            raise Unavailable("registry unavailable, cannot delete across the fleet", detail=exc) from exc
        deleted = self.store.delete(cid)
        return deleted or prev in (FleetState.READY, FleetState.BUILDING)

    def reconcile(self) -> tuple[int, int, list[str]]:
        """The registry from the object store: every stored artifact READY (unless a tombstone
        says it was deleted: then the object is garbage and goes), READY entries whose object
        is gone removed, builds lost with their job FAILED, contexts whose manifest fails its
        check DAMAGED. -> (added, removed, damaged)."""
        try:
            outcome = reconcile_fleet(self.fleet, self.store, self.artifact_uri)
            self.fleet.mark_reconciled(self.location)
            return outcome
        except RegistryUnavailable as exc:
            raise Unavailable("registry unavailable", detail=exc) from exc

    def registry_available(self) -> bool:
        try:
            return self.fleet.ping()
        except Exception:  # noqa: BLE001 - a health probe answers, it does not raise
            return False
