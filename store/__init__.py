"""ctxcache.store: context artifacts in LMDB (+ zstd where it pays), optionally as the local cache
of a shared object store (tiered_store.py), and the build registry.

Exports resolve lazily (PEP 562) so that `ctxcache.store.registry`, `keys` and `ids` stay
importable without torch: registry and scheduling logic import no torch (STYLE.md).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ArtifactStore": "artifact_store",
    "StoreConfig": "config", "StoreStats": "config", "VerifyReport": "config", "BadChunk": "config",
    "ContextMeta": "manifest", "Manifest": "manifest", "ChunkInfo": "manifest",
    "STORE_FORMAT": "manifest",
    "StoreError": "errors", "CorruptArtifact": "errors", "StoreFull": "errors",
    "StoreClosed": "errors", "StoreUnavailable": "errors", "StoreDeadline": "errors", "StoreDamaged": "lmdb_file", "FormatMismatch": "errors",
    "context_id_for": "ids",
    "ManifestKey": "keys", "ChunkKey": "keys", "AccessKey": "keys", "PromptKey": "keys",
    "BuildLockKey": "keys",
    "Registry": "registry", "EmbeddedRegistry": "registry", "RegistryEntry": "registry",
    "BuildState": "registry", "RegistryUnavailable": "registry", "ReconcileReport": "registry",
    "reconcile": "registry",
    "RedisRegistry": "redis_registry", "RedisConfig": "redis_registry",
    "ObjectArtifactStore": "object_store", "ObjectStoreConfig": "object_config",
    "TieredStore": "tiered_store", "TieredConfig": "read_through", "open_store": "tiered_store",
    "ObjectTier": "tiers", "TierConfig": "tiers", "open_tier": "tiers", "request_deadline": "tiers.guard",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ctxcache.store' has no attribute {name!r}")
    return getattr(importlib.import_module(f"ctxcache.store.{module}"), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = sorted(_EXPORTS)
