"""Configuration of the shared artifact tier (no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ctxcache.store.tiers.base import TierConfig
from ctxcache.store.tiers.guard import GuardConfig


@dataclass(frozen=True)
class ObjectStoreConfig:
    budget_bytes: int | None = None  # stored bytes kept before LRU eviction; None: no budget
    verify_on_load: str = "xxh3"  # checksum every fetched chunk must match: xxh3 | sha256
    gc_grace_s: float = 3600.0  # objects nothing references are deleted only once this old
    access_granularity_s: float = 60.0  # a process records a context's use at most this often
    # a put's chunks are encoded and uploaded on this many threads as the build hands them over
    # (object_writer.py); each chunk is one PUT, so this is also the uploads in flight
    put_threads: int = 16  # as many as a batch of the tier (TierConfig.threads) ran before
    # chunk bytes handed over and not yet uploaded; a build that gets further ahead waits
    put_inflight_bytes: int = 1 << 30
    tier: TierConfig = field(default_factory=TierConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)  # a hung store fails fast (tiers/guard.py)

    def __post_init__(self) -> None:
        if self.budget_bytes is not None and self.budget_bytes <= 0:
            raise ValueError(f"budget_bytes={self.budget_bytes} must be None or > 0")
        if self.verify_on_load not in ("xxh3", "sha256"):
            raise ValueError(f"verify_on_load={self.verify_on_load!r} must be xxh3 or sha256 "
                             "(every object is checked: some servers store bad bytes silently)")
        if self.put_threads < 1 or self.put_inflight_bytes < 1:
            raise ValueError(f"put_threads={self.put_threads} and put_inflight_bytes={self.put_inflight_bytes} "
                             "must be >= 1")
        if self.gc_grace_s < 0 or self.access_granularity_s < 0:
            raise ValueError(f"gc_grace_s={self.gc_grace_s} and access_granularity_s="
                             f"{self.access_granularity_s} must be >= 0")
