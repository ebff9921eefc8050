"""ctxcache.store: context artifacts and the facts about them. Its rooms:

- `lmdb/`: this machine's copy, LMDB (+ zstd where it pays): the ArtifactStore, its data file's
  check, the operations inside one transaction.
- `object/`: the shared object tier, the copy of record: its store, layout of objects, budget and GC.
- `tiers/`: the byte back ends of the object tier (file, S3) and the deadline guard around them.
- `registries/`: the build registry (embedded, Redis) and the fleet's (its Lua scripts, the job stream,
  its reconcile with the object store).
- beside them, what they share: the artifact's layout, manifest, chunk I/O and codec, keys and ids,
  config and errors, eviction policy, the load arena; and `tiered_store.py`, LMDB in front of the
  shared tier (`read_through.py`: its read path).

Exports resolve lazily (PEP 562) so that `ctxcache.store.registries.registry`, `keys` and `ids`
stay importable without torch: registry and scheduling logic import no torch (STYLE.md).
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ArtifactStore": "lmdb.artifact_store",
    "StoreConfig": "config", "StoreStats": "config", "VerifyReport": "config", "BadChunk": "config",
    "ContextMeta": "manifest", "Manifest": "manifest", "ChunkInfo": "manifest",
    "STORE_FORMAT": "manifest",
    "StoreError": "errors", "CorruptArtifact": "errors", "StoreFull": "errors",
    "StoreClosed": "errors", "StoreUnavailable": "errors", "StoreDeadline": "errors", "StoreDamaged": "lmdb.lmdb_file", "FormatMismatch": "errors",
    "context_id_for": "ids",
    "ManifestKey": "keys", "ChunkKey": "keys", "AccessKey": "keys", "PromptKey": "keys",
    "BuildLockKey": "keys",
    "Registry": "registries.registry", "EmbeddedRegistry": "registries.registry", "RegistryEntry": "registries.registry",
    "BuildState": "registries.registry", "RegistryUnavailable": "registries.registry", "ReconcileReport": "registries.registry",
    "reconcile": "registries.registry",
    "RedisRegistry": "registries.redis_registry", "RedisConfig": "registries.redis_registry",
    "ObjectArtifactStore": "object.object_store", "ObjectStoreConfig": "object.object_config",
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
