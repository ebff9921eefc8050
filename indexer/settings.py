"""The indexer's settings: the server's default method and K/V codec, and the bounds on the
builds it admits (queue, context length, clustering work, time) and runs (lanes, chunk)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ctxcache.store.registries.registry import CLAIM_LEASE_S


@dataclass(frozen=True)
class IndexerSettings:
    method: str = "csattention"
    method_params: dict[str, Any] = field(default_factory=dict, hash=False)
    queue_limit: int = 64  # queued builds beyond this -> RESOURCE_EXHAUSTED
    max_context_tokens: int = 0  # 0: the model's maximum length - 256
    chunk: int = 0  # prefill tokens per forward pass; 0: by device (indexer.build.prefill_chunk)
    store_queries: int = 1536  # prefill query positions kept per layer when PutContext asks (keep_queries)
    kv_codec: str = "int8"  # PutContext's default K/V codec (measured: bench storage, README)
    claim_lease_s: float = CLAIM_LEASE_S  # registry build claims, renewed every lease/3 while building
    build_timeout_s: float = 1800.0  # a build running longer is cancelled (FAILED), never wedges the queue
    # a build's clustering work (SparseMethod.build_work, point-centroid distances) above this is
    # refused at PutContext, unless it is the server's own method and params: the default
    # CSAttention build is 1.0e9 on SmolLM2, 3.0e9 on Llama-3.1-8B at any length (8 x 128:
    # 1.2e10); 64 subspaces x 512 centroids x 4096 queries x 100 iterations, 1.2e12
    max_build_work: float = 3e10
    build_lanes: int = 2  # builds in progress at once (one per tenant), taking turns to compute

    def __post_init__(self) -> None:
        from ctxcache.artifact import KV_CODECS
        from ctxcache.methods import make_method
        try:  # the server's default method must build: a bad one fails at start, not at a PutContext
            make_method(self.method, self.method_params)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"indexer.method={self.method!r} method_params={self.method_params}: {exc}") from None
        if self.kv_codec not in KV_CODECS:
            raise ValueError(f"indexer.kv_codec={self.kv_codec!r} must be one of {KV_CODECS}")
        if self.claim_lease_s <= 0:
            raise ValueError(f"indexer.claim_lease_s={self.claim_lease_s} must be > 0")
        if not self.build_timeout_s > 0:
            raise ValueError(f"indexer.build_timeout_s={self.build_timeout_s} must be > 0")
        if not self.max_build_work > 0 or self.build_lanes < 1:
            raise ValueError(f"indexer.max_build_work={self.max_build_work} must be > 0 and "
                             f"build_lanes={self.build_lanes} >= 1")
        if self.queue_limit < 1 or self.chunk < 0 or self.max_context_tokens < 0 or self.store_queries < 0:
            raise ValueError(f"queue_limit={self.queue_limit} must be >= 1, chunk={self.chunk} >= 0 "
                             f"and max_context_tokens={self.max_context_tokens}, store_queries="
                             f"{self.store_queries} >= 0")
