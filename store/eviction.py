"""Which contexts to evict: pure functions over small summaries (no LMDB, no torch)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Summary:
    context_id: str
    stored_bytes: int
    last_access: float
    pinned: bool
    expired: bool


def expired(entries: Iterable[Summary]) -> list[str]:
    return [e.context_id for e in entries if e.expired and not e.pinned]


def lru_order(entries: Iterable[Summary], exclude: frozenset[str] = frozenset()) -> list[Summary]:
    """Evictable entries, expired first, then least recently used first; pinned never."""
    cands = [e for e in entries if not e.pinned and e.context_id not in exclude]
    return sorted(cands, key=lambda e: (not e.expired, e.last_access, e.context_id))


def victims_for(entries: list[Summary], need_bytes: int, budget_bytes: int,
                exclude: frozenset[str] = frozenset()) -> list[str] | None:
    """Fewest LRU victims so that used + need_bytes <= budget_bytes; None if impossible.

    Expired entries are always included (they are gone for readers anyway)."""
    used = sum(e.stored_bytes for e in entries if e.context_id not in exclude)
    out: list[str] = []
    for e in lru_order(entries, exclude):
        if used + need_bytes <= budget_bytes and not e.expired:
            break
        out.append(e.context_id)
        used -= e.stored_bytes
    return out if used + need_bytes <= budget_bytes else None
