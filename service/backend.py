"""The service's one seam onto store/ and the registry, so servicers never juggle both.

The store (LMDB, this machine) is the source of truth; the registry is an index that
`reconcile` rebuilds. Registry failures therefore fail only what needs the registry: a new
build's claim (PutContext -> UNAVAILABLE, fast); bookkeeping after a stored build is best
effort (logged, repaired by Reconcile), and Generate never touches the registry.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from ctxcache.artifact import ContextArtifact
from ctxcache.service.cached_context import CachedContext
from ctxcache.service.errors import NotFound, Unavailable
from ctxcache.store import ArtifactStore, ContextMeta, Manifest, Registry, RegistryUnavailable, reconcile
from ctxcache.store.config import StoreStats, VerifyReport
from ctxcache.store.tiered_store import TieredStore
from ctxcache.store.fleet_registry import Facts

log = logging.getLogger("ctxcache.service.backend")
ROLES_LABEL = "ctxcache/roles"


class Backend:
    def __init__(self, store: ArtifactStore, registry: Registry, registry_kind: str) -> None:
        self.store, self.registry, self.registry_kind = store, registry, registry_kind
        self.location = store.location  # the server replaces it with its host:port once bound

    # ---- builds -------------------------------------------------------------------------------
    def claim_build(self, cid: str, lease_s: float) -> bool:
        try:
            return self.registry.claim_build(cid, cid, self.location, lease_s)
        except RegistryUnavailable as exc:
            raise Unavailable("registry unavailable, cannot start a build", detail=exc) from exc

    def ready_elsewhere(self, cid: str) -> str | None:
        """The location of cid if the registry has it READY on another worker, else None."""
        try:
            entry = self.registry.get(cid)
        except RegistryUnavailable as exc:
            raise Unavailable("registry unavailable, cannot start a build", detail=exc) from exc
        if entry is not None and entry.state.value == "READY" and entry.location != self.location:
            return entry.location or "another worker"
        return None

    def relocate(self, location: str) -> None:
        """Record this worker in the registry as `location` (its reachable host:port)."""
        self.location = location
        self.store.config = replace(self.store.config, location=location)

    def renew_claim(self, cid: str, lease_s: float) -> None:
        self._best_effort("renew_build", cid, lease_s)

    def put(self, cid: str, art: ContextArtifact, meta: ContextMeta) -> Manifest:
        manifest = self.store.put(cid, art, meta)
        self._best_effort("mark_ready", cid, cid, self.location)
        return manifest

    def build_failed(self, cid: str, error: str) -> None:
        self._best_effort("mark_failed", cid, cid, error[:500], self.location)

    def _best_effort(self, op: str, *args) -> None:
        try:
            getattr(self.registry, op)(*args)
        except RegistryUnavailable as exc:
            log.warning("registry %s(%s) skipped (Reconcile repairs it): %s", op, args[0][:12], exc)

    # ---- reads --------------------------------------------------------------------------------
    def manifest(self, cid: str) -> Manifest | None:
        return self.store.manifest(cid)

    def existing(self, cid: str) -> Manifest | None:
        """The manifest of a stored context a Put need not build again (a fleet's: not damaged)."""
        return self.manifest(cid)

    def damage(self, cid: str) -> str:
        """Why cid is DAMAGED ("" if it is not); only a fleet's registry keeps this state."""
        return ""

    def damaged(self) -> list[Facts]:
        return []

    def mark_damaged(self, cid: str, why: str) -> bool:
        return False

    def get(self, cid: str, with_queries: bool = False) -> ContextArtifact | None:
        return self.store.get(cid, with_queries)

    def load(self, cid: str) -> CachedContext:
        """Store -> DRAM for the decoder; NOT_FOUND if absent, CorruptArtifact -> DATA_LOSS."""
        m = self.store.manifest(cid)
        art = self.store.get(cid) if m is not None else None
        if m is None or art is None:
            raise NotFound(f"context {cid} not found")
        roles = tuple(m.labels.get(ROLES_LABEL, "system").split(","))
        return CachedContext(art, roles, m.stored_bytes)

    def list(self, limit: int, after: str | None, tenant: str | None = None) -> list[Manifest]:
        """tenant: only this tenant's contexts (None: every tenant)."""
        return self.store.list_manifests(limit=limit, after=after, tenant=tenant)

    def missing(self, cid: str) -> str:
        """Why cid is not here: absent, or (per the registry) stored by another worker."""
        try:
            entry = self.registry.get(cid)
        except Exception:  # noqa: BLE001 - the registry is a hint here, never a failure
            entry = None
        if entry is not None and entry.location and entry.location != self.location:
            return (f"context {cid} is not in this worker's store; the registry has it "
                    f"{entry.state.value} at {entry.location}")
        return f"context {cid} not found"

    def fleet_facts(self, cid: str):  # noqa: ANN201 - fleet_backend.FleetFacts there; one node has none
        return None

    def context_ids(self) -> list[str]:
        return self.store.context_ids()

    def verify(self, cid: str) -> VerifyReport:
        return self.store.verify(cid)

    def stats(self) -> StoreStats:
        return self.store.stats()

    # ---- admin --------------------------------------------------------------------------------
    def drop_local(self, cid: str) -> bool:
        """Forget this worker's copy of cid (its local store's), the object store's kept; False
        where there is no object store (the local copy is then the only one)."""
        return isinstance(self.store, TieredStore) and self.store.drop_local(cid)

    def delete(self, cid: str) -> bool:
        deleted = self.store.delete(cid)
        self._best_effort("delete", cid)
        return deleted

    def update_ttl(self, cid: str, ttl_s: float | None) -> Manifest | None:
        """TTL counted from now (None: no expiry); None if cid is not stored here."""
        return self.store.update_meta(cid, ttl_s=ttl_s)

    def reconcile(self) -> tuple[int, int, list[str]]:
        """-> (entries added, removed, damaged contexts skipped: a fleet's only)."""
        try:
            report = reconcile(self.registry, self.store)
        except RegistryUnavailable as exc:
            raise Unavailable("registry unavailable", detail=exc) from exc
        return len(report.added), len(report.removed), []

    def registry_available(self) -> bool:
        try:
            return bool(self.registry.ping())
        except Exception:  # noqa: BLE001 - a health probe answers, it does not raise
            return False

    def close(self) -> None:
        self.store.close()
        self.registry.close()
