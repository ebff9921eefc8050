"""Prometheus metrics of one service instance (own registry, so several servers can coexist
in one process, e.g. in tests). `serve` exposes them over HTTP with --metrics-port."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

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
        self.kernel_compiles_after_ready = Gauge("ctxcache_kernel_compiles_after_ready", "Triton kernels compiled "
                                                 "since warm-up ended (0 when every shape was built before SERVING)",
                                                 registry=r)
        self.rejected = Counter("ctxcache_rejected", "requests refused for capacity", ["rpc"], registry=r)
