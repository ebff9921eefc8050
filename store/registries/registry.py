"""The build registry: prompt hash -> context id, build state, location (no torch, no LMDB).

The registry is an index over the stores, never the only copy of anything: `reconcile`
rebuilds it from an ArtifactStore. `claim_build` makes concurrent identical PutContext calls
cause exactly one build: one caller wins the claim (Redis SET NX with a lease; a lock here),
the others poll the entry until it is READY or FAILED.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Protocol

from ctxcache.store.errors import CorruptArtifact
from ctxcache.store.keys import check_id

# A build claim's lease. Builders renew it while they build (the service's indexer every
# lease/3), so it only has to outlive a renewal gap; a crashed builder's claim then lapses
# within this many seconds instead of blocking identical PutContexts for the whole build.
CLAIM_LEASE_S = 30.0


class RegistryUnavailable(Exception):
    """The registry backend cannot be reached (service: UNAVAILABLE). Raised fast. The message
    names the address (server log, admin callers); `public` is what a tenant reads."""

    public = "registry unavailable"


class BuildState(str, Enum):
    BUILDING = "BUILDING"
    READY = "READY"
    FAILED = "FAILED"
    DAMAGED = "DAMAGED"  # a stored chunk or manifest failed its check: a Put of its content rebuilds it


@dataclass(frozen=True)
class RegistryEntry:
    prompt_hash: str
    context_id: str
    state: BuildState
    location: str = ""  # which store holds (or will hold) the artifact
    error: str = ""  # why a build FAILED, or what failed its check (DAMAGED)
    updated_at: float = 0.0
    tenant: str = ""  # whose context (READY, DAMAGED): who may see it once its manifest is unreadable

    def __post_init__(self) -> None:
        check_id(self.prompt_hash, "prompt_hash")
        check_id(self.context_id)
        object.__setattr__(self, "state", BuildState(self.state))


class Registry(ABC):
    clock: Callable[[], float] = staticmethod(time.time)

    @abstractmethod
    def get(self, prompt_hash: str) -> RegistryEntry | None: ...

    @abstractmethod
    def put(self, entry: RegistryEntry) -> None:
        """Insert or replace the entry of entry.prompt_hash."""

    @abstractmethod
    def delete(self, prompt_hash: str) -> bool: ...

    @abstractmethod
    def entries(self) -> Iterator[RegistryEntry]: ...

    @abstractmethod
    def claim_build(self, prompt_hash: str, context_id: str, location: str = "",
                    lease_s: float = CLAIM_LEASE_S) -> bool:
        """True for exactly one caller while no READY entry exists and no live claim is held;
        the winner's entry becomes BUILDING. A claim lapses after lease_s unless renewed, so a
        crashed builder blocks identical builds for at most one lease."""

    @abstractmethod
    def renew_build(self, prompt_hash: str, lease_s: float = CLAIM_LEASE_S) -> bool:
        """Extend this process's claim to lease_s from now; False if it no longer holds it."""

    @abstractmethod
    def release_build(self, prompt_hash: str) -> None:
        """Drop this process's claim (no-op if it holds none)."""

    @abstractmethod
    def build_claimed(self, prompt_hash: str) -> bool:
        """Whether a live (unexpired) claim exists for prompt_hash, by anyone."""

    def mark_ready(self, prompt_hash: str, context_id: str, location: str = "", tenant: str = "") -> RegistryEntry:
        entry = RegistryEntry(prompt_hash, context_id, BuildState.READY, location,
                              updated_at=self.clock(), tenant=tenant)
        self.put(entry)
        self.release_build(prompt_hash)
        return entry

    def mark_damaged(self, prompt_hash: str, context_id: str, error: str, location: str = "",
                     tenant: str = "") -> bool:
        """DAMAGED with error (the tenant kept from the entry when not given), unless it is being
        built again; -> whether this call marked it (False: already DAMAGED, or building)."""
        cur = self.get(prompt_hash)
        if cur is not None and (cur.state == BuildState.DAMAGED
                                or (cur.state == BuildState.BUILDING and self.build_claimed(prompt_hash))):
            return False
        self.put(RegistryEntry(prompt_hash, context_id, BuildState.DAMAGED, location or (cur.location if cur else ""),
                               error, self.clock(), tenant or (cur.tenant if cur else "")))
        return True

    def mark_failed(self, prompt_hash: str, context_id: str, error: str,
                    location: str = "") -> RegistryEntry:
        entry = RegistryEntry(prompt_hash, context_id, BuildState.FAILED, location, error,
                              self.clock())
        self.put(entry)
        self.release_build(prompt_hash)
        return entry

    def ping(self) -> bool:
        return True

    def close(self) -> None:
        return None


@dataclass
class EmbeddedRegistry(Registry):
    """In-process registry (the default for one machine); thread safe."""

    clock: Callable[[], float] = time.time
    _entries: dict[str, RegistryEntry] = field(default_factory=dict)
    _claims: dict[str, float] = field(default_factory=dict)  # prompt hash -> lease end
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def get(self, prompt_hash: str) -> RegistryEntry | None:
        with self._lock:
            return self._entries.get(check_id(prompt_hash, "prompt_hash"))

    def put(self, entry: RegistryEntry) -> None:
        with self._lock:
            self._entries[entry.prompt_hash] = entry

    def delete(self, prompt_hash: str) -> bool:
        with self._lock:
            return self._entries.pop(prompt_hash, None) is not None

    def entries(self) -> Iterator[RegistryEntry]:
        with self._lock:
            return iter(list(self._entries.values()))

    def claim_build(self, prompt_hash: str, context_id: str, location: str = "",
                    lease_s: float = CLAIM_LEASE_S) -> bool:
        now = self.clock()
        with self._lock:
            cur = self._entries.get(check_id(prompt_hash, "prompt_hash"))
            if self._claims.get(prompt_hash, 0.0) > now or (cur and cur.state == BuildState.READY):
                return False
            self._claims[prompt_hash] = now + lease_s
            self._entries[prompt_hash] = RegistryEntry(prompt_hash, context_id,
                                                       BuildState.BUILDING, location, "", now)
            return True

    def release_build(self, prompt_hash: str) -> None:
        with self._lock:
            self._claims.pop(prompt_hash, None)

    def renew_build(self, prompt_hash: str, lease_s: float = CLAIM_LEASE_S) -> bool:
        now = self.clock()
        with self._lock:
            if self._claims.get(prompt_hash, 0.0) <= now:
                return False
            self._claims[prompt_hash] = now + lease_s
            return True

    def build_claimed(self, prompt_hash: str) -> bool:
        with self._lock:
            return self._claims.get(prompt_hash, 0.0) > self.clock()


class ManifestSource(Protocol):
    """What reconcile needs from an ArtifactStore (kept structural: no store import here)."""

    location: str

    def list_manifests(self, offset: int = 0, limit: int = 100, labels=None, tenant=None,  # noqa: ANN001
                       after: str | None = None) -> list: ...

    def manifest(self, context_id: str) -> object | None: ...


@dataclass(frozen=True)
class ReconcileReport:
    added: tuple[str, ...]  # prompt hashes added from the store
    removed: tuple[str, ...]  # prompt hashes whose artifact is gone
    kept: int
    foreign: int  # entries at other locations, left alone
    damaged: tuple[str, ...] = ()  # context ids kept DAMAGED (a Put of their content rebuilds them)


def _stored(store: ManifestSource) -> dict[str, object]:
    out, after = {}, None
    while page := store.list_manifests(limit=500, after=after):
        out.update({m.context_id: m for m in page})
        after = page[-1].context_id
    return out


def reconcile(registry: Registry, store: ManifestSource) -> ReconcileReport:
    """Make the registry agree with the store at store.location.

    READY (or abandoned BUILDING) entries whose artifact is missing are removed; an abandoned
    BUILDING entry whose artifact is stored becomes READY; every stored artifact whose key (its
    prompt_hash, else its context id) has no entry, or a FAILED one for the same context, gets
    a READY entry. Other FAILED entries and live claims are kept, DAMAGED ones too while their
    objects are there (reported); entries at other locations are not judged."""
    stored, where = _stored(store), store.location
    added, removed, kept, foreign, damaged = [], [], 0, 0, []
    present: dict[str, RegistryEntry] = {}
    for e in registry.entries():
        if e.location not in (where, ""):
            foreign += 1
        elif e.state == BuildState.FAILED or (e.state == BuildState.BUILDING
                                              and registry.build_claimed(e.prompt_hash)):
            kept += 1
        elif e.context_id in stored or _present(store, e.context_id):
            if e.state == BuildState.DAMAGED:
                damaged.append(e.context_id)
            elif e.state != BuildState.READY:
                e = replace(e, state=BuildState.READY, location=where, updated_at=registry.clock())
                registry.put(e)
            kept += 1
        else:
            registry.delete(e.prompt_hash)
            removed.append(e.prompt_hash)
            continue
        present[e.prompt_hash] = e
    for cid, m in stored.items():
        key = getattr(m, "prompt_hash", "") or cid
        e = present.get(key)
        if e is None or (e.state == BuildState.FAILED and e.context_id == cid):
            registry.put(RegistryEntry(key, cid, BuildState.READY, where, "", registry.clock(),
                                       getattr(m, "tenant", "")))
            added.append(key)
    return ReconcileReport(tuple(added), tuple(removed), kept, foreign, tuple(damaged))


def _present(store: ManifestSource, context_id: str) -> bool:
    """Expired contexts are absent; a corrupt one is present (reads answer DATA_LOSS)."""
    try:
        return store.manifest(context_id) is not None
    except CorruptArtifact:
        return True
