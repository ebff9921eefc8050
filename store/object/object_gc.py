"""The shared tier's budget, TTL and garbage collection (policy in eviction.py, shared with LMDB).

LRU uses each context's access mark (object_layout.ACCESS: the time of its last recorded use,
written by `touch`), else its creation time. GC is safe against live writers by age alone: objects are listed before the
manifests are read, so a chunk is an orphan only if no manifest read afterwards names it AND it
is older than the grace period (longer than any write takes).
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ctxcache.store import eviction
from ctxcache.store.object import object_layout as lay
from ctxcache.store.errors import StoreFull

if TYPE_CHECKING:
    from ctxcache.store.object.object_store import ObjectArtifactStore


@dataclass(frozen=True)
class GcReport:
    expired: tuple[str, ...]  # contexts deleted because their TTL passed
    orphan_chunks: int  # chunk objects no manifest names (a dead or superseded writer's)
    orphan_bytes: int
    stale_access: int  # access marks of contexts that are gone
    partials: int  # a dead writer's temp files (file://)


def _last_use(raw: bytes | None) -> float:
    return struct.unpack("<d", raw)[0] if raw is not None and len(raw) == 8 else 0.0


def summaries(store: "ObjectArtifactStore") -> list[eviction.Summary]:
    ids = store.context_ids()
    marks = store.tier.get_many([lay.access_key(cid) for cid in ids])
    now, out = store._clock(), []
    for cid, m, mark in zip(ids, store.read_manifests(ids), marks):
        if m is None:  # unreadable: evicted first under pressure, never "expired" (verify reports it)
            out.append(eviction.Summary(cid, 0, 0.0, False, False))
        else:
            out.append(eviction.Summary(cid, m.stored_bytes, max(m.created_at, _last_use(mark)),
                                        m.pinned, m.expired(now)))
    return out


def make_room(store: "ObjectArtifactStore", context_id: str, need: int) -> None:
    """Evict expired, then LRU unpinned contexts so `need` more bytes fit the budget."""
    budget = store.config.budget_bytes
    assert budget is not None
    if need > budget:
        raise StoreFull(f"context {context_id} needs {need} bytes, over the shared store budget of {budget} bytes")
    victims = eviction.victims_for(summaries(store), need, budget, frozenset({context_id}))
    if victims is None:
        raise StoreFull(f"{need} bytes do not fit the shared store budget of {budget} bytes even after "
                        "evicting every unpinned context")
    for cid in victims:
        store.delete(cid)


def victims_to_budget(entries: list[eviction.Summary], budget: int | None) -> list[str]:
    if budget is None:
        return eviction.expired(entries)
    victims = eviction.victims_for(entries, 0, budget)
    return victims if victims is not None else [e.context_id for e in eviction.lru_order(entries)]


def collect_garbage(store: "ObjectArtifactStore", grace_s: float) -> GcReport:
    expired = store.evict_expired()
    # listed before the manifests are read (see the module doc)
    objects, folders = store.tier.list(lay.VERSION), store.tier.folders(lay.CHUNKS)
    cutoff = time.time() - grace_s  # object mtimes are wall-clock times of the server
    kinds = [(o, lay.parse_key(o.key)) for o in objects]
    ids = sorted({p.context_id for _, p in kinds if p is not None and p.kind == "manifest"})
    named: set[str] = set()  # write folders some manifest names
    unreadable: set[str] = set()
    for cid, m in zip(ids, store.read_manifests(ids)):
        if m is None:
            unreadable.add(cid)  # its chunks stay until it is deleted (verify reports it)
        else:
            named.add(lay.folder_of(m))
    files: dict[str, list] = {f.key: [] for f in folders if lay.context_of_folder(f.key) is not None}
    for o, p in kinds:
        if p is not None and p.kind == "chunk":
            files.setdefault(f"{lay.CHUNKS}/{p.folder}", []).append(o)
    mtimes = {f.key: f.mtime for f in folders}
    orphans = [(folder, objs) for folder, objs in files.items()
               if folder not in named and lay.context_of_folder(folder) not in unreadable
               and _old(objs, mtimes.get(folder, 0.0), cutoff)]
    for folder, _ in orphans:
        store.tier.delete_prefix(folder)
    present = set(ids)
    stale = [o.key for o, p in kinds if p is not None and p.kind == "access" and p.context_id not in present
             and o.mtime < cutoff]
    store.tier.delete_many(stale)
    partials = store.tier.sweep_partials(lay.VERSION, cutoff)
    return GcReport(tuple(expired), sum(len(objs) for _, objs in orphans),
                    sum(o.size for _, objs in orphans for o in objs), len(stale), partials)


def _old(objs: list, folder_mtime: float, cutoff: float) -> bool:
    """Every chunk of the write is older than the cutoff; an empty folder only if its own time
    is known and old (S3 keeps none: such a folder may be a live writer's first moment)."""
    if objs:
        return all(o.mtime < cutoff for o in objs)
    return 0.0 < folder_mtime < cutoff
