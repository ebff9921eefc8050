"""The roles of a `ctxcache serve` process (--role): what it builds, serves and shares.

- all (the default): one node. PutContext builds in this process into the local store; the
  registry is embedded (or Redis with --redis); no object store.
- indexer: builds only. Takes jobs from the Redis stream (indexer/fleet_indexer.py), writes artifacts
  to the object store, and serves health (ContextService and AdminService answer where to go);
  reconciles the registry at start and collects the object store's garbage (indexer/fleet_janitor.py).
- decoder: serves PutContext (it enqueues: indexer/remote_builds.py), Generate (artifacts load on
  demand from the object store through the local store) and the admin API; it heartbeats the
  contexts it holds hot and drops those deleted anywhere (decoder/fleet_presence.py).
"""

from __future__ import annotations

import grpc

from ctxcache.client.gen.v1 import admin_pb2_grpc, context_pb2_grpc
from ctxcache.models.loader import LoadedModel
from ctxcache.decoder.artifact_cache import ArtifactCache
from ctxcache.indexer.build_queue import BuildQueue
from ctxcache.service.config import ServiceConfig
from ctxcache.service.fleet_backend import FleetBackend
from ctxcache.indexer.remote_builds import RemoteBuilds
from ctxcache.indexer.fleet_indexer import FleetIndexer
from ctxcache.indexer.fleet_janitor import Janitor
from ctxcache.decoder.fleet_presence import Presence
from ctxcache.decoder.generate_streams import GenerateStreams
from ctxcache.metrics import Metrics
from ctxcache.prompting import Prompter
from ctxcache.store import TieredStore
from ctxcache.store.registries.fleet_registry import FleetRegistry
from ctxcache.store.registries.job_stream import JobStream


def fleet_backend(config: ServiceConfig, store: TieredStore) -> FleetBackend:
    """store: the worker's LMDB as its cache in front of the object store (server.py opens it)."""
    fleet = FleetRegistry(config.registry.redis_config(), config.fleet.tombstone_s)
    return FleetBackend(store, fleet, config.fleet.role)


def remote_builds(config: ServiceConfig, lm: LoadedModel, prompter: Prompter, backend: FleetBackend,
                  metrics: Metrics, kv_dtype: str) -> RemoteBuilds:
    stream = JobStream(config.registry.redis_config(), "decoder", config.fleet.build_lease_s)
    return RemoteBuilds(lm, prompter, backend, stream, config.indexer, kv_dtype, metrics, claim_s(config))


def claim_s(config: ServiceConfig) -> float:
    """How long a build's claim outlives its last beat: a queued job waits for an indexer, and
    a running one is taken over after the lease, so the claim covers the whole build bound."""
    return config.indexer.build_timeout_s + config.fleet.build_lease_s


class FleetRuntime:
    """The role's background work, started once the worker knows its address."""

    def __init__(self, config: ServiceConfig, backend, builds, decoder: GenerateStreams) -> None:  # noqa: ANN001
        self.config, self.backend, self.builds, self.decoder = config, backend, builds, decoder
        self.indexer: FleetIndexer | None = None
        self.presence: Presence | None = None
        self.janitor: Janitor | None = None

    def start(self, worker: str) -> None:
        f = self.config.fleet
        if f.role == "indexer":
            stream = JobStream(self.config.registry.redis_config(), worker, f.build_lease_s)
            self.indexer = FleetIndexer(self.builds, self.backend, stream, worker, f.build_lease_s,
                                        claim_s(self.config))
            self.janitor = Janitor(self.backend, worker, f.gc_interval_s, f.gc_grace_s, f.heartbeat_s)
        elif f.role == "decoder":
            cache: ArtifactCache = self.decoder.cache
            self.presence = Presence(self.backend, worker, cache.keys, self.decoder.evict, f.heartbeat_s)

    def stop_taking(self) -> None:
        """Before the builds are cancelled: take no new job (the one in flight is handed back)."""
        if self.indexer is not None:
            self.indexer.close()

    def close(self) -> None:
        if self.janitor is not None:
            self.janitor.close()
        if self.indexer is not None:
            self.indexer.join()
        if self.presence is not None:
            self.presence.close()


class IndexerOnly(context_pb2_grpc.ContextServiceServicer, admin_pb2_grpc.AdminServiceServicer):
    """On an indexer, every context and admin RPC says where to go instead of "Method not found!"."""

    async def _refuse(self, request, context):
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                            "this worker is an indexer (--role indexer): it only builds; send "
                            "PutContext, Generate and admin calls to a decoder")

    PutContext = GetContext = ListContexts = DeleteContext = Generate = _refuse
    Evict = Rebuild = Verify = Stats = Describe = Reconcile = _refuse


def make_builds(config: ServiceConfig, lm: LoadedModel, prompter: Prompter, backend, metrics: Metrics,  # noqa: ANN001
                kv_dtype: str) -> BuildQueue | RemoteBuilds:
    if config.fleet.role == "decoder":
        return remote_builds(config, lm, prompter, backend, metrics, kv_dtype)
    return BuildQueue(lm, prompter, backend, config.indexer, kv_dtype, metrics)
