"""The fleet registry rebuilt from the object store, the copy of record (no torch): what an
indexer's janitor runs at start and when Redis comes back empty (indexer/fleet_janitor.py), and
a fleet's Reconcile (service/fleet_backend.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from ctxcache.store.errors import CorruptArtifact, FormatMismatch
from ctxcache.store.manifest import Manifest
from ctxcache.store.registries.fleet_registry import FleetRegistry, FleetState

if TYPE_CHECKING:
    from ctxcache.store.tiered_store import TieredStore

log = logging.getLogger("ctxcache.service.fleet")


def reconcile_fleet(fleet: FleetRegistry, store: "TieredStore", uri_of: Callable[[str], str]
                    ) -> tuple[int, int, list[str]]:
    """-> (entries added, stale entries removed or failed, damaged contexts marked and skipped).
    Safe beside running workers: every change is a conditional script, and an entry is dropped
    only after a second look at the object store (a build may have finished since the listing)."""
    queued = fleet.queued_jobs()  # before the entries: a job enqueued later holds its claim
    stored: dict[str, Manifest] = {}
    after = None
    while page := store.list_manifests(limit=500, after=after):
        stored.update({m.context_id: m for m in page})
        after = page[-1].context_id
    added = removed = 0
    for cid, m in stored.items():
        outcome = fleet.record_ready(cid, uri_of(cid), m.tenant, m.n_tokens)
        if outcome == "DELETED":
            store.delete(cid)  # its delete reached Redis but not the object store
        added += outcome == "ADDED"
    damaged: list[str] = []
    unlisted = [cid for cid in store.shared.context_ids() if cid not in stored]  # expired, or unreadable
    for f in fleet.entries():
        if f.state == FleetState.READY and f.context_id not in stored:
            if not _present(fleet, store, f.context_id, damaged):
                removed += fleet.drop_ready(f)
        elif f.state == FleetState.BUILDING and f.job_id not in queued:
            removed += fleet.fail_lost(f, "lost: no indexer holds this build and its job is not on the stream; "
                                          "PutContext builds it again")
    for cid in unlisted:
        if cid not in damaged:
            _present(fleet, store, cid, damaged)
    return added, removed, damaged


def _present(fleet: FleetRegistry, store: "TieredStore", cid: str, damaged: list[str]) -> bool:
    """Whether the object store holds a live manifest of cid. One that fails its check marks cid
    DAMAGED (appended to `damaged`) instead of failing the whole reconcile; one of a format this
    server does not read is left alone (another version's)."""
    try:
        return store.shared.manifest(cid) is not None
    except CorruptArtifact as exc:
        fleet.mark_damaged(cid, str(exc))
        damaged.append(cid)
        log.warning("reconcile: context %s is DAMAGED (skipped): %s", cid[:12], exc)
    except FormatMismatch as exc:
        log.warning("reconcile: context %s skipped: %s", cid[:12], exc)
    return True
