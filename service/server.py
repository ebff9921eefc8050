"""create_server(config) -> (server, port): wires model, store, registry, workers and gRPC (aio); the
parts it assembles from the config are built in assembly.py."""

from __future__ import annotations

import logging
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ctxcache.decoder.runner import ReferenceRunner
from ctxcache.kernels.compiles import CompileCounter
from ctxcache.models.cpu_layout import usable_cores
from ctxcache.models.loader import LoadedModel
from ctxcache.service import roles
from ctxcache.service.rpc.access_log import AccessLogInterceptor
from ctxcache.service.rpc.admin import AdminServicer
from ctxcache.service.auth import Auth, AuthInterceptor
from ctxcache.service.rpc.calls import LoopThread, ParseInterceptor
from ctxcache.decoder.artifact_cache import ArtifactCache
from ctxcache.service.assembly import (cap_to_slots, decode_runners, load_configured_model, open_store_and_registry,
                                      reconcile)
from ctxcache.service.backend import Backend
from ctxcache.service.config import ServiceConfig
from ctxcache.decoder.cached_context import CachedContext
from ctxcache.decoder.generate_streams import GenerateStreams
from ctxcache.client.gen.v1 import admin_pb2, admin_pb2_grpc, context_pb2, context_pb2_grpc
from ctxcache.metrics import Metrics
from ctxcache.prompting import ByteTokenizer, Prompter, ensure_chat_template
from ctxcache.service.rpc.servicer import ContextServicer
from ctxcache.service.warmup import warm_up_server
from ctxcache.service.warm_up_check import check_warm_up
from ctxcache.service.gc_watch import freeze_and_watch, thaw

log = logging.getLogger("ctxcache.service")
CONTEXT_SERVICE = context_pb2.DESCRIPTOR.services_by_name["ContextService"].full_name
ADMIN_SERVICE = admin_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name


class CtxcacheServer:
    """The running service: main (and optional admin) grpc.aio servers on their own event loop,
    plus the build queue and decode engines."""

    def __init__(self, config: ServiceConfig, lm: LoadedModel) -> None:
        self.config, self.lm, self.metrics = config, lm, Metrics()
        self.compiles = CompileCounter.install()
        self.metrics.kernel_compiles_after_ready.set_function(self.compiles.after_ready)
        role = config.fleet.role
        store, registry, kind = open_store_and_registry(config)
        self.backend = Backend(store, registry, kind) if role == "all" else roles.fleet_backend(config, store)
        prompter = Prompter(lm.tokenizer if lm.tokenizer is not None else ByteTokenizer())
        d, s = config.decoder, config.server
        cache = ArtifactCache[CachedContext](d.dram_cache_bytes, self.backend.load, CachedContext.nbytes)
        self.indexer = roles.make_builds(config, lm, prompter, self.backend, self.metrics, "float16")
        runners = [ReferenceRunner(lm)] if role == "indexer" else decode_runners(lm, config)  # an indexer decodes nothing
        self.decoder = GenerateStreams(lm, prompter, cache, s.max_streams, d.schedule, self.metrics,
                                       runners, d.max_batch, d.decode_mode)
        self.fleet = roles.FleetRuntime(config, self.backend, self.indexer, self.decoder)
        self.metrics.offload_hit_rate.set_function(self.decoder.offload_hit_rate)
        self.metrics.resident_contexts.set_function(lambda: self.decoder.held_contexts()[0])
        self.metrics.offloaded_contexts.set_function(lambda: self.decoder.held_contexts()[1])
        self.metrics.track_store_loads(self.backend.store)
        cap_to_slots(self.indexer, self.decoder.engines)
        self.auth = Auth(dict(s.tenant_tokens), s.auth_token)
        self.pool = ThreadPoolExecutor(s.threads, "ctxcache-rpc")
        self.loop = LoopThread()
        self.health = self.loop.run(_make_health())
        self.servers: list[grpc.aio.Server] = []
        self.port = self.admin_port = self.http_port = 0
        self.http = None  # the HTTP front (service/http/), when config.server.http_port is set
        self.draining = threading.Event()
        self.ready = threading.Event()  # set once SERVING (warm)
        self._stopped = threading.Event()

    def _new_server(self) -> grpc.aio.Server:
        s = self.config.server
        opts = [("grpc.max_send_message_length", s.max_message_bytes),
                ("grpc.max_receive_message_length", s.max_message_bytes),
                ("grpc.so_reuseport", 0)]
        interceptors = [AuthInterceptor(self.auth, (f"/{ADMIN_SERVICE}/", "/grpc.reflection."))] \
            if self.auth.enabled else []
        server = grpc.aio.server(interceptors=[AccessLogInterceptor(), *interceptors, ParseInterceptor()], options=opts)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        self.servers.append(server)
        return server

    def _bind(self, server: grpc.aio.Server, port: int) -> int:
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
        if self.config.server.http_port is not None:  # first: a port in use then leaves nothing started
            from ctxcache.service.http.front import HttpFront  # FastAPI and uvicorn only when asked for
            self.http = HttpFront(self)
            self.http_port = self.http.start(self.config.server.http_port)
        self.port = self.loop.run(self._start())  # health NOT_SERVING until the runners are warm
        warm_up_server(self.lm, [e.runner for e in self.decoder.engines], self.config, self.compiles)
        freeze_and_watch()
        self.loop.run(self._set_health(health_pb2.HealthCheckResponse.SERVING))
        self.ready.set()  # the HTTP front's /health says ok from here on
        self.backend.relocate(self.config.server.advertised(self.port))
        if self.config.fleet.role == "all":
            reconcile(self.backend)  # the store is the truth; repair the index at start
        self.fleet.start(self.backend.location)  # a fleet: an indexer reconciles (indexer/fleet_janitor.py)
        log.info("serving on %s:%d (admin %d, http %s) as %s", self.config.server.host, self.port, self.admin_port,
                 self.http_port or "off", self.backend.location)
        return self.port

    async def _start(self) -> int:
        s, d = self.config.server, self.config.decoder
        main = self._new_server()
        indexer_only = self.config.fleet.role == "indexer"
        context_pb2_grpc.add_ContextServiceServicer_to_server(roles.IndexerOnly() if indexer_only else
            ContextServicer(self.indexer, self.decoder, d.default_max_tokens, d.max_tokens_limit, self.pool,
                            self.auth, self.draining.is_set), main)
        admin = main if s.admin_port is None else self._new_server()
        admin_pb2_grpc.add_AdminServiceServicer_to_server(roles.IndexerOnly() if indexer_only else
                                                          AdminServicer(self.indexer, self.decoder, self.pool), admin)
        elsewhere = AdminElsewhere()
        if admin is not main:
            admin_pb2_grpc.add_AdminServiceServicer_to_server(elsewhere, main)
        names = [CONTEXT_SERVICE, ADMIN_SERVICE, health.SERVICE_NAME]
        if s.reflection:
            reflection.enable_server_reflection([*names, reflection.SERVICE_NAME], admin)
        port = self._bind(main, s.port)
        self.admin_port = port if admin is main else self._bind(admin, s.admin_port)
        elsewhere.port = self.admin_port
        for server in self.servers:
            await server.start()
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        return port

    async def _set_health(self, status) -> None:
        for name in ("", CONTEXT_SERVICE, ADMIN_SERVICE, health.SERVICE_NAME):
            await self.health.set(name, status)

    def stop(self, grace: float | None = None) -> None:
        """Drain: health NOT_SERVING and new RPCs refused (UNAVAILABLE) while the port stays
        open, builds cancelled, live streams get `grace` s to finish (each ends with its Final),
        streams still running then end with UNAVAILABLE; then the ports close and the store."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        grace = self.config.server.grace_seconds if grace is None else grace
        self.draining.set()
        self.loop.run(self.health.enter_graceful_shutdown())
        self.fleet.stop_taking()  # an indexer takes no new job; the one in flight goes back to the stream
        self.indexer.close()  # cancels queued and running builds, joins the builder
        self.fleet.close()
        end = time.monotonic() + grace
        while self.decoder.active and time.monotonic() < end:
            time.sleep(0.05)
        if self.decoder.active:
            log.warning("grace of %.1fs over: ending %d live streams", grace, self.decoder.active)
        self.decoder.shutdown("the server is shutting down")
        end = time.monotonic() + 2.0
        while self.decoder.active and time.monotonic() < end:
            time.sleep(0.02)
        if self.http is not None:
            self.http.stop()
        self.loop.run(_stop_all(self.servers, 0.5))
        self.decoder.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.backend.close()
        self.loop.close()
        thaw()


async def _make_health():
    return health.aio.HealthServicer()


async def _stop_all(servers: list[grpc.aio.Server], grace: float) -> None:
    for server in servers:
        await server.stop(grace)


class AdminElsewhere(admin_pb2_grpc.AdminServiceServicer):
    """On the main port when AdminService is served apart: say where, not "Method not found!"."""

    def __init__(self) -> None:
        self.port = 0

    async def _refuse(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                            f"AdminService is served on the admin port ({self.port}), not on this one")

    Evict = Rebuild = Verify = Stats = Describe = Reconcile = _refuse


SWITCH_INTERVAL_S = 0.0005


def create_server(config: ServiceConfig, lm: LoadedModel | None = None) -> tuple[CtxcacheServer, int]:
    """Build and start the service; -> (server, bound port). `lm`: reuse an already loaded model
    (then no warm-up check: the child would need a second copy's memory beside it)."""
    torch.set_num_threads(config.decoder.torch_threads or usable_cores())
    # The decode loop shares the interpreter with the gRPC handlers: after each step's device
    # sync it waits for the interpreter lock, up to the switch interval (5 ms by default, half a
    # GPU decode step). 0.5 ms lets it back within a small fraction of a step.
    sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
    if lm is None:
        check_warm_up(config)  # a GPU server: its warm-up first runs in a child, which a compiler crash ends
        lm = load_configured_model(config)
    if lm.tokenizer is not None:
        ensure_chat_template(lm.tokenizer, config.model.chat_template, config.model.model)
    server = CtxcacheServer(config, lm)
    try:
        return server, server.start()
    except BaseException:
        if server.http is not None:
            server.http.stop()
        server.indexer.close()
        server.backend.close()
        server.loop.close()
        raise
