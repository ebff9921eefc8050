"""What the indexer's modules use of the service's Backend, the seam onto the store and the
registry (service/backend.py; a fleet worker's service/fleet_backend.py). The service wires
one in; the indexer names only these methods, so it never imports the service."""

from __future__ import annotations

from typing import Protocol

from ctxcache.artifact import ContextArtifact
from ctxcache.store import ContextMeta, Manifest, TieredStore
from ctxcache.store.artifact_writer import ArtifactWriter
from ctxcache.store.registries.fleet_registry import Facts, FleetRegistry


class BuildBackend(Protocol):
    """A BuildQueue's: the build's claim, its write (`writer`: the store's, handed each layer as
    the build finishes it; `put` finishes it, or stores a whole artifact) and failure, and what
    is stored already."""

    def existing(self, cid: str) -> Manifest | None: ...
    def claim_build(self, cid: str, lease_s: float) -> bool: ...
    def ready_elsewhere(self, cid: str) -> str | None: ...
    def renew_claim(self, cid: str, lease_s: float) -> None: ...
    def writer(self, cid: str, meta: ContextMeta) -> ArtifactWriter: ...
    def put(self, cid: str, art: ContextArtifact, meta: ContextMeta,
            writer: ArtifactWriter | None = None) -> Manifest: ...
    def build_failed(self, cid: str, error: str) -> None: ...
    def manifest(self, cid: str) -> Manifest | None: ...
    def damaged_facts(self, cid: str) -> Facts | None: ...


class FleetBuildBackend(BuildBackend, Protocol):
    """A fleet worker's (FleetIndexer, RemoteBuilds): the registry's facts and the object store."""

    fleet: FleetRegistry
    store: TieredStore

    def facts(self, cid: str) -> Facts | None: ...
    def artifact_uri(self, cid: str) -> str: ...
    def get(self, cid: str, with_queries: bool = False) -> ContextArtifact | None: ...
