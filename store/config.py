"""The store's frozen configuration and the small reports it returns (no torch)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass(frozen=True)
class StoreConfig:
    map_size_bytes: int = 64 << 30  # LMDB map; fixed for the store's life (never resized live)
    budget_bytes: int = 48 << 30  # stored artifact bytes kept before LRU eviction
    zstd_level: int = 3
    # compress a chunk only if zstd saves at least this fraction: raw loads ~5x faster here, so
    # only big wins (tokens, constant tables) pay; 0.1 favours disk space (store/README.md)
    min_gain: float = 0.75
    sample_bytes: int = 1 << 20  # bytes tried before compressing a whole chunk
    verify_on_load: str = "xxh3"  # checksum checked on get(): xxh3 | sha256 | none
    track_access: bool = True  # get() records the access time (LRU); off for read-only workers
    access_granularity_s: float = 1.0  # rewrite the access time at most this often
    huge_pages: bool = False  # THP-advised load memory: faster when warm, 1.8 s stalls when cold (arena.py)
    # encode/decode/hash threads (zstd, hashlib and the K/V codecs release the GIL): one per core
    # up to 16. On a 16-core H200 host, 16 threads checked a 2.1 GB artifact's chunks at 46 GB/s
    # (xxh3; 6.5 on one) and copied them into pinned memory at 41 GB/s.
    threads: int = field(default_factory=lambda: max(1, min(16, os.cpu_count() or 1)))
    # load into page-locked memory: a GPU runner's copy of the (coded) K/V to HBM is then
    # asynchronous at PCIe speed; needs CUDA (the service turns it on when it decodes on a GPU)
    pin_memory: bool = False
    max_readers: int = 126
    sync: bool = True  # fsync at commit (a process crash is safe either way; power loss is not)
    readonly: bool = False
    location: str = ""  # what the registry records as this store's location; "" = its path
    max_put_evictions: int = 10_000  # MapFullError retries before StoreFull

    def __post_init__(self) -> None:
        if self.map_size_bytes < 1 << 20:
            raise ValueError(f"map_size_bytes={self.map_size_bytes} must be >= 1 MiB")
        if not 0 < self.budget_bytes <= self.map_size_bytes:
            raise ValueError(f"budget_bytes={self.budget_bytes} must be in (0, map_size_bytes="
                             f"{self.map_size_bytes}]")
        if not 1 <= self.zstd_level <= 22:
            raise ValueError(f"zstd_level={self.zstd_level} must be in [1, 22]")
        if self.verify_on_load not in ("xxh3", "sha256", "none"):
            raise ValueError(f"verify_on_load={self.verify_on_load!r} must be xxh3, sha256 or none")
        if not 0.0 <= self.min_gain < 1.0:
            raise ValueError(f"min_gain={self.min_gain} must be in [0, 1)")
        for name in ("sample_bytes", "threads", "max_readers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.access_granularity_s < 0 or self.max_put_evictions < 0:
            raise ValueError(f"access_granularity_s={self.access_granularity_s} and "
                             f"max_put_evictions={self.max_put_evictions} must be >= 0")


@dataclass(frozen=True)
class BadChunk:
    chunk: str  # "<layer>:<name>" or "manifest"
    reason: str


@dataclass(frozen=True)
class VerifyReport:
    context_id: str
    found: bool
    checked: int  # chunks whose stored bytes were hashed
    bad: tuple[BadChunk, ...] = ()

    @property
    def ok(self) -> bool:
        return self.found and not self.bad


@dataclass(frozen=True)
class StoreStats:
    contexts: int
    pinned: int
    corrupt_manifests: int
    stored_bytes: int  # artifact bytes as stored (what the budget counts)
    raw_bytes: int  # the same artifacts decoded
    raw_kv_bytes: int  # K and V alone, decoded
    raw_table_bytes: int
    budget_bytes: int
    map_size_bytes: int
    map_used_bytes: int  # LMDB pages in use, including free-list and overhead

    @property
    def stored_over_kv(self) -> float:
        """Artifact bytes per raw KV byte (the issue's 'artifact bytes vs raw KV bytes')."""
        return self.stored_bytes / self.raw_kv_bytes if self.raw_kv_bytes else 0.0
