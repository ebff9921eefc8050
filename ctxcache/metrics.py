"""Prometheus metrics of one service instance (own registry, so several servers can coexist
in one process, e.g. in tests), counted by the indexer's builds, the decoder's streams and the
fronts. `serve` exposes them over HTTP with --metrics-port."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 1, 2, 5, 10, 30)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.builds = Counter("ctxcache_builds", "context builds by outcome", ["outcome"], registry=r)
        self.build_seconds = Histogram("ctxcache_build_seconds", "build wall time",
                                       buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300), registry=r)
        self.put_requests = Counter("ctxcache_put_requests", "PutContext by result",
                                    ["result"], registry=r)  # created | existing | joined
        self.cache_lookups = Counter("ctxcache_artifact_cache", "DRAM artifact lookups",
                                     ["result"], registry=r)  # hit | miss
        self.bytes_loaded = Counter("ctxcache_artifact_bytes_loaded", "bytes loaded from the store",
                                    registry=r)
        self.load_seconds = Histogram("ctxcache_artifact_load_seconds", "store -> DRAM load time",
                                      buckets=_LATENCY, registry=r)
        self.ttft = Histogram("ctxcache_ttft_seconds", "time to first token", buckets=_LATENCY, registry=r)
        self.tokens_per_second = Histogram("ctxcache_tokens_per_second", "decode speed per stream",
                                           buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500), registry=r)
        self.generated_tokens = Counter("ctxcache_generated_tokens", "tokens generated", registry=r)
        self.decode_paths = Counter("ctxcache_decode_path", "Generate streams by the runner that decoded them",
                                    ["path"], registry=r)
        self.streams = Gauge("ctxcache_active_streams", "Generate streams in progress", registry=r)
        # the offload runner (K/V in host memory): selected keys found in its GPU cache, over all selected
        self.offload_hit_rate = Gauge("ctxcache_offload_hit_rate", "offload runner: fraction of selected keys read "
                                      "from the GPU cache instead of host memory", registry=r)
        # admission by capacity (serve --offload): contexts held in HBM slots and in host slots
        self.resident_contexts = Gauge("ctxcache_resident_contexts", "contexts held in the GPU runner's HBM "
                                       "slots", registry=r)
        self.offloaded_contexts = Gauge("ctxcache_offloaded_contexts", "contexts held in the offload runner's "
                                        "host slots (K/V in page-locked host memory)", registry=r)
        self.offload_promotions = Counter("ctxcache_offload_promotions", "streams whose context moved from a host "
                                          "slot to an HBM slot", registry=r)
        self.kernel_compiles_after_ready = Gauge("ctxcache_kernel_compiles_after_ready", "Triton kernels compiled "
                                                 "since warm-up ended (0 when every shape was built before SERVING)",
                                                 registry=r)
        self.rejected = Counter("ctxcache_rejected", "requests refused for capacity", ["rpc"], registry=r)

    def track_store_loads(self, store: object) -> None:
        """Export the store's loads per tier (TieredStore.load_stats), read at each scrape."""
        if hasattr(store, "load_stats"):
            self.registry.register(_StoreLoads(store.load_stats))


class _StoreLoads:
    """Loads answered by the local LMDB and by the object store: count, bytes, seconds (rate()
    of bytes over seconds is the load bandwidth), and the loads that failed, by reason."""

    def __init__(self, snapshot: Callable[[], Any]) -> None:
        self._snapshot = snapshot

    def collect(self):  # noqa: ANN201 (prometheus collector protocol)
        snap = self._snapshot()
        fams = {name: CounterMetricFamily(f"ctxcache_store_load_{name}", f"store loads answered per tier: {name}",
                                          labels=["tier"]) for name in ("hits", "bytes", "seconds")}
        for tier, t in snap.tiers.items():
            for name in fams:
                fams[name].add_metric([tier], getattr(t, name))
        failed = CounterMetricFamily("ctxcache_store_load_failures", "store loads that failed or found "
                                     "nothing, by reason", labels=["reason"])
        for reason in ("misses", "unavailable", "corrupt"):
            failed.add_metric([reason], getattr(snap, reason))
        shared = CounterMetricFamily("ctxcache_store_shared_downloads", "loads that joined another "
                                     "caller's download of the same context")
        shared.add_metric([], snap.shared_downloads)
        yield from (*fams.values(), failed, shared)
