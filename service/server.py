"""create_server(config) -> (server, port): wires model, store, registry, workers and gRPC."""

from __future__ import annotations

import hmac
import logging
import threading
from concurrent import futures

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ctxcache.decoder import SparseConfig
from ctxcache.decoder.runner import ReferenceRunner, Runner
from ctxcache.methods import make_method
from ctxcache.models.loader import LoadedModel, load_model
from ctxcache.service.admin import AdminServicer
from ctxcache.service.artifact_cache import ArtifactCache
from ctxcache.service.backend import Backend
from ctxcache.service.config import ServiceConfig
from ctxcache.service.cached_context import CachedContext
from ctxcache.service.generate_streams import GenerateStreams
from ctxcache.service.gen.v1 import admin_pb2, admin_pb2_grpc, context_pb2, context_pb2_grpc
from ctxcache.service.build_queue import BuildQueue
from ctxcache.service.metrics import Metrics
from ctxcache.service.prompting import ByteTokenizer, Prompter
from ctxcache.service.servicer import ContextServicer
from ctxcache.store import ArtifactStore, EmbeddedRegistry, StoreConfig, reconcile

log = logging.getLogger("ctxcache.service")
CONTEXT_SERVICE = context_pb2.DESCRIPTOR.services_by_name["ContextService"].full_name
ADMIN_SERVICE = admin_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class _BearerAuth(grpc.ServerInterceptor):
    """Every RPC but health checks needs `authorization: Bearer <token>` (constant-time compare)."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or details.method.startswith("/grpc.health.v1.Health/"):
            return handler
        given = dict(details.invocation_metadata).get("authorization", "")
        if hmac.compare_digest(given.encode(), self._expected):
            return handler

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "authorization: missing or wrong bearer token")

        make = grpc.unary_stream_rpc_method_handler if handler.response_streaming else \
            grpc.unary_unary_rpc_method_handler
        return make(deny, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)


class CtxcacheServer:
    """The running service: main (and optional admin) gRPC servers plus workers."""

    def __init__(self, config: ServiceConfig, lm: LoadedModel) -> None:
        self.config, self.lm, self.metrics = config, lm, Metrics()
        self.backend = Backend(*_open_store_and_registry(config))
        prompter = Prompter(lm.tokenizer if lm.tokenizer is not None else ByteTokenizer())
        d, s = config.decoder, config.server
        cache = ArtifactCache[CachedContext](d.dram_cache_bytes, self.backend.load, CachedContext.nbytes)
        self.indexer = BuildQueue(lm, prompter, self.backend, config.indexer, "float16", self.metrics)
        self.decoder = GenerateStreams(lm, prompter, cache, s.max_streams, d.schedule, self.metrics,
                                       decode_runners(lm, config), d.max_batch, d.decode_mode == "dense")
        self.health = health.HealthServicer()
        self.servers: list[grpc.Server] = []
        self.port = self.admin_port = 0
        self._stopped = threading.Event()

    def _new_server(self) -> grpc.Server:
        s = self.config.server
        opts = [("grpc.max_send_message_length", s.max_message_bytes),
                ("grpc.max_receive_message_length", s.max_message_bytes),
                ("grpc.so_reuseport", 0)]
        interceptors = [_BearerAuth(s.auth_token)] if s.auth_token else []
        server = grpc.server(futures.ThreadPoolExecutor(s.threads, "ctxcache-rpc"),
                             interceptors=interceptors, options=opts)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        self.servers.append(server)
        return server

    def _bind(self, server: grpc.Server, port: int) -> int:
        s = self.config.server
        address = f"{s.host}:{port}"
        if s.tls_cert is not None:
            creds = grpc.ssl_server_credentials([(s.tls_key.read_bytes(), s.tls_cert.read_bytes())])
            bound = server.add_secure_port(address, creds)
        else:
            bound = server.add_insecure_port(address)
        if bound == 0:
            raise OSError(f"cannot bind {address}")
        return bound

    def start(self) -> int:
        s = self.config.server
        main = self._new_server()
        context_pb2_grpc.add_ContextServiceServicer_to_server(
            ContextServicer(self.indexer, self.decoder, self.config.decoder.default_max_tokens,
                            self.config.decoder.max_tokens_limit), main)
        admin = main if s.admin_port is None else self._new_server()
        admin_pb2_grpc.add_AdminServiceServicer_to_server(AdminServicer(self.indexer, self.decoder), admin)
        names = [CONTEXT_SERVICE, ADMIN_SERVICE, health.SERVICE_NAME]
        if s.reflection:
            reflection.enable_server_reflection([*names, reflection.SERVICE_NAME], admin)
        self.port = self._bind(main, s.port)
        self.admin_port = self.port if admin is main else self._bind(admin, s.admin_port)
        for server in self.servers:
            server.start()
        for name in ("", *names):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("serving on %s:%d (admin %d)", s.host, self.port, self.admin_port)
        return self.port

    def stop(self, grace: float | None = None) -> None:
        """Health NOT_SERVING, refuse new RPCs, drain running ones for `grace` s, close the store."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.health.enter_graceful_shutdown()
        grace = self.config.server.grace_seconds if grace is None else grace
        events = [server.stop(grace) for server in self.servers]
        for event in events:
            event.wait()
        self.indexer.close()
        self.decoder.close()
        self.backend.close()


def decode_runners(lm: LoadedModel, config: ServiceConfig) -> list[Runner]:
    """On a GPU: the fast runner (sparse when the method has a GPU selector, or dense), then the
    reference runner for every other method and schedule; on a CPU: the reference runner."""
    reference = ReferenceRunner(lm)
    if lm.model.lm_head.weight.device.type != "cuda":
        return [reference]
    from ctxcache.decoder.gpu.runner import GpuRunner  # Triton only where a GPU is
    d, ix = config.decoder, config.indexer
    method = make_method(ix.method, ix.method_params)
    if d.decode_mode == "sparse" and not method.caps.gpu_decode:
        return [reference]
    params = method.params if d.decode_mode == "sparse" else None
    fast = GpuRunner(lm, params, SparseConfig.from_schedule(d.schedule), d.gpu_slots, d.gpu_slot_tokens)
    log.info("GPU runner %s: %d slots of %d tokens", fast.name, d.gpu_slots, d.gpu_slot_tokens)
    return [fast, reference]


def _open_store_and_registry(config: ServiceConfig):
    budget = config.store.budget_bytes
    store = ArtifactStore(config.store.path, StoreConfig(map_size_bytes=budget + budget // 4 + (64 << 20),
                                                         budget_bytes=budget))
    url = config.registry.redis_url
    if url is None:
        registry, kind = EmbeddedRegistry(), "embedded"
    else:
        from ctxcache.store import RedisRegistry
        registry, kind = RedisRegistry(config.registry.redis_config()), "redis"
    try:
        report = reconcile(registry, store)  # the store is the truth; repair the index at start
        log.info("reconciled registry: %d added, %d removed", len(report.added), len(report.removed))
    except Exception as exc:  # noqa: BLE001 - Redis down at start: serve, Reconcile later
        log.warning("registry reconcile at start failed: %s", exc)
    return store, registry, kind


def create_server(config: ServiceConfig, lm: LoadedModel | None = None) -> tuple[CtxcacheServer, int]:
    """Build and start the service; -> (server, bound port). `lm`: reuse an already loaded model."""
    if config.decoder.torch_threads:
        torch.set_num_threads(config.decoder.torch_threads)
    if lm is None:
        m = config.model
        lm = load_model(m.model, _DTYPES[m.dtype], m.device)
    server = CtxcacheServer(config, lm)
    try:
        return server, server.start()
    except BaseException:
        server.backend.close()
        raise
