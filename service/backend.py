"""The service's one seam onto store/ and the registry, so servicers never juggle both.

The store (LMDB, this machine) is the source of truth; the registry is an index that
`reconcile` rebuilds. Registry failures therefore fail only what needs the registry: a new
build's claim (PutContext -> UNAVAILABLE, fast); bookkeeping after a stored build is best
effort (logged, repaired by Reconcile), and Generate never touches the registry.

Damage is a state here as in a fleet (fleet_backend.py keeps it in Redis through the same
methods): a chunk or manifest that fails its check on a read marks the context DAMAGED in the
registry (GetContext and ListContexts show it; the read itself still answers DATA_LOSS), a Put
of its content removes its objects and builds it again (`existing`), Delete and Evict remove
it, and `admin verify --repair` marks what Verify finds. With the embedded registry the mark
lives as long as the process; the next failing read marks it again.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from ctxcache.artifact import ContextArtifact
from ctxcache.decoder.cached_context import CachedContext
from ctxcache.indexer.job_spec import ROLES_LABEL
from ctxcache.errors import NotFound, Unavailable
from ctxcache.store import (ArtifactStore, ContextMeta, CorruptArtifact, Manifest, Registry, RegistryUnavailable,
                            reconcile)
from ctxcache.store.artifact_writer import ArtifactWriter
from ctxcache.store.config import StoreStats, VerifyReport
from ctxcache.store.registries.registry import BuildState
from ctxcache.store.tiered_store import TieredStore
from ctxcache.store.registries.fleet_registry import Facts, FleetState

log = logging.getLogger("ctxcache.service.backend")


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

    def writer(self, cid: str, meta: ContextMeta) -> ArtifactWriter:
        return self.store.writer(cid, meta)

    def put(self, cid: str, art: ContextArtifact, meta: ContextMeta, writer: ArtifactWriter | None = None) -> Manifest:
        manifest = (writer or self.store.writer(cid, meta)).finish(art)
        self._best_effort("mark_ready", cid, cid, self.location, meta.tenant)
        return manifest

    def build_failed(self, cid: str, error: str) -> None:
        self._best_effort("mark_failed", cid, cid, error[:500], self.location)

    def _best_effort(self, op: str, *args) -> None:
        try:
            getattr(self.registry, op)(*args)
        except RegistryUnavailable as exc:
            log.warning("registry %s(%s) skipped (Reconcile repairs it): %s", op, args[0][:12], exc)

    # ---- reads: a stored object failing its check marks the context DAMAGED, then raises ----
    def manifest(self, cid: str) -> Manifest | None:
        try:
            return self.store.manifest(cid)
        except CorruptArtifact as exc:
            self.mark_damaged(cid, str(exc))
            raise

    def load(self, cid: str) -> CachedContext:
        """Store -> DRAM for the decoder; NOT_FOUND if absent, CorruptArtifact -> DATA_LOSS
        (the context marked DAMAGED first). From the object store the artifact comes back as
        it lands (TieredStore.get_landing): its readers wait for its layers."""
        get = getattr(self.store, "get_landing", self.store.get)  # an object store download lands
        try:
            m = self.store.manifest(cid)
            art = get(cid) if m is not None else None
        except CorruptArtifact as exc:  # a chunk, or the manifest
            self.mark_damaged(cid, str(exc))
            raise
        if m is None or art is None:
            raise NotFound(f"context {cid} not found")
        if art.landing is not None:  # a chunk that fails its check after this returned
            def damaged(exc: BaseException) -> None:
                if isinstance(exc, CorruptArtifact):
                    self.mark_damaged(cid, str(exc))
            art.landing.on_fail(damaged)
        roles = tuple(m.labels.get(ROLES_LABEL, "system").split(","))
        return CachedContext(art, roles, m.stored_bytes)

    def get(self, cid: str, with_queries: bool = False) -> ContextArtifact | None:
        return self.store.get(cid, with_queries)

    # ---- damage ---------------------------------------------------------------------------------
    def record_manifest(self, cid: str) -> Manifest | None:
        """The manifest of the copy of record (a fleet's: the object store's)."""
        return self.store.manifest(cid)

    def existing(self, cid: str) -> Manifest | None:
        """The manifest of an intact stored context a Put need not build again; for a damaged one
        None, after removing its objects, so the build that follows writes it whole."""
        try:
            m = self.record_manifest(cid)
            damaged = m is not None and self.damaged_facts(cid) is not None
        except CorruptArtifact as exc:
            self.mark_damaged(cid, str(exc))
            m, damaged = None, True
        if damaged:
            log.warning("context %s is DAMAGED: its objects go, a new build replaces them", cid[:12])
            self.store.delete(cid)
            return None
        return m

    def damaged_facts(self, cid: str) -> Facts | None:
        """What the registry knows of cid if it is DAMAGED (why, whose), else None (also with
        the registry unavailable: the read's DATA_LOSS then speaks alone)."""
        try:
            entry = self.registry.get(cid)
        except RegistryUnavailable:
            return None
        return _damage(entry) if entry is not None and entry.state == BuildState.DAMAGED else None

    def damage(self, cid: str) -> str:
        """Why cid is DAMAGED ("" if it is not)."""
        f = self.damaged_facts(cid)
        return "" if f is None else f.error or "damaged"

    def damaged(self) -> list[Facts]:
        try:
            return self._damaged()
        except RegistryUnavailable as exc:
            log.warning("registry unavailable: damaged contexts not listed: %s", exc)
            return []

    def _damaged(self) -> list[Facts]:
        return [_damage(e) for e in self.registry.entries() if e.state == BuildState.DAMAGED]

    def mark_damaged(self, cid: str, why: str, tenant: str = "") -> bool:
        """Best effort (registry down: the next check marks it); -> whether this call marked it."""
        try:
            marked = self._mark_damaged(cid, why[:500], tenant)
        except RegistryUnavailable as exc:
            log.warning("context %s is damaged (%s) but the registry is unavailable: %s", cid[:12], why, exc)
            return False
        if marked:
            log.warning("context %s marked DAMAGED: %s", cid[:12], why)
        return marked

    def _mark_damaged(self, cid: str, why: str, tenant: str) -> bool:
        """The tenant: given, else the registry's (recorded when it was built), else the manifest's."""
        if not tenant and (e := self.registry.get(cid)) is not None:
            tenant = e.tenant
        return self.registry.mark_damaged(cid, cid, why, self.location, tenant or self._tenant(cid))

    def _tenant(self, cid: str) -> str:
        try:
            m = self.store.manifest(cid)
        except CorruptArtifact:  # nobody knows whose: shown to admin callers only
            return ""
        return "" if m is None else m.tenant

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
        """-> (entries added, removed, DAMAGED contexts kept as they are)."""
        try:
            report = reconcile(self.registry, self.store)
        except RegistryUnavailable as exc:
            raise Unavailable("registry unavailable", detail=exc) from exc
        return len(report.added), len(report.removed), list(report.damaged)

    def registry_available(self) -> bool:
        try:
            return bool(self.registry.ping())
        except Exception:  # noqa: BLE001 - a health probe answers, it does not raise
            return False

    def close(self) -> None:
        self.store.close()
        self.registry.close()


def _damage(entry) -> Facts:  # noqa: ANN001 - a RegistryEntry
    """A DAMAGED registry entry as the facts GetContext and ListContexts show (a fleet's shape)."""
    return Facts(entry.context_id, FleetState.DAMAGED, tenant=entry.tenant, error=entry.error or "damaged",
                 updated_at=entry.updated_at)
