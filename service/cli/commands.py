"""What each `ctxcache` subcommand does (arguments come parsed from main.py). The server side
(serve, demo, generate-local) imports torch when it runs; the client commands live in
client.py and admin.py, which import none."""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ctxcache.client import Client
from ctxcache.client.gen.v1 import context_pb2 as pb
from ctxcache.service.cli.client import env_token, method_params, stream_answer, timings

if TYPE_CHECKING:
    from ctxcache.service.config import ServiceConfig


def run(args) -> int:
    from ctxcache.service.cli import client as cli_client

    handler = {"serve": serve, "put": cli_client.put, "generate": cli_client.generate, "admin": admin,
               "health": cli_client.health, "demo": demo, "generate-local": generate_local}[args.command]
    return handler(args)  # errors become one line in cli.main


def service_config(args, port: int, host: str = "127.0.0.1", admin_port: int | None = None,
                   token: str | None = None, tls: tuple[Path | None, Path | None] = (None, None),
                   tenant_tokens: tuple[tuple[str, str], ...] = ()) -> ServiceConfig:
    from ctxcache.service.config import (GiB, DecoderSettings, IndexerSettings, ModelConfig, RegistrySettings,
                                         ServerConfig, ServiceConfig, StoreSettings)
    from ctxcache.service.config import FleetSettings

    return ServiceConfig(
        server=ServerConfig(host=host, port=port, admin_port=admin_port, max_streams=args.max_streams,
                            threads=max(64, args.max_streams + 16), auth_token=token,
                            tenant_tokens=tenant_tokens, tls_cert=tls[0], tls_key=tls[1],
                            grace_seconds=getattr(args, "grace", 5.0), advertise=getattr(args, "advertise", ""),
                            http_port=getattr(args, "http_port", None),
                            auto_cache_min_tokens=0 if getattr(args, "no_auto_cache", False)
                            else getattr(args, "auto_cache_min_tokens", 1024)),
        model=ModelConfig(args.model, args.device, args.dtype, getattr(args, "chat_template", None)),
        store=StoreSettings(args.data, int(args.store_budget_gb * GiB),
                            object_store_uri=getattr(args, "object_store", None),
                            host_pool_bytes=_gib_or_none(getattr(args, "host_pool_gb", None))),
        registry=RegistrySettings(args.redis),
        indexer=IndexerSettings(method=args.method, store_queries=args.store_queries, kv_codec=args.kv_codec,
                                max_build_work=getattr(args, "max_build_work", 3e10),
                                method_params=method_params(getattr(args, "method_params", "{}"), "--method-params")),
        decoder=DecoderSettings(dram_cache_bytes=int(args.dram_cache_gb * GiB), schedule=args.schedule,
                                torch_threads=args.threads, max_batch=args.max_batch,
                                decode_mode=args.decode_mode, gpu_slot_tokens=args.gpu_slot_tokens,
                                offload=getattr(args, "offload", False),
                                offload_slots=getattr(args, "offload_slots", 4),
                                offload_slot_tokens=getattr(args, "offload_slot_tokens", 0),
                                offload_k=getattr(args, "offload_k", "hbm"),
                                offload_v_cache=getattr(args, "offload_v_cache", DecoderSettings.offload_v_cache),
                                offload_prefill_graphs=getattr(args, "offload_prefill_graphs",
                                                               DecoderSettings.offload_prefill_graphs),
                                warm_up_check=getattr(args, "warm_up_check", True),
                                **_gpu_slots(args)),
        fleet=FleetSettings(getattr(args, "role", "all"), getattr(args, "build_lease", 10.0),
                            getattr(args, "heartbeat", 2.0), gc_interval_s=getattr(args, "gc_interval", 600.0),
                            gc_grace_s=getattr(args, "gc_grace", 3600.0)))


def _gpu_slots(args) -> dict:
    """--gpu-slots or --gpu-memory-gb (never both): the fixed count, or the HBM that sizes it."""
    slots, memory = getattr(args, "gpu_slots", None), getattr(args, "gpu_memory_gb", None)
    if slots is not None and memory is not None:
        raise ValueError("give --gpu-slots or --gpu-memory-gb, not both (the memory decides the slots)")
    if memory is not None:
        if not memory > 0:
            raise ValueError(f"--gpu-memory-gb {memory} must be > 0")
        from ctxcache.service.config import GiB
        return {"gpu_memory_bytes": int(memory * GiB)}
    return {} if slots is None else {"gpu_slots": slots}


def env_switch(name: str) -> bool:
    """An on/off environment variable: unset, empty, 0, false, no: off; 1, true, yes: on."""
    value = os.environ.get(name, "").strip().lower()
    if value in ("", "0", "false", "no"):
        return False
    if value in ("1", "true", "yes"):
        return True
    raise ValueError(f"{name}={value[:20]!r} must be 1 or 0 (true or false)")


def tenant_tokens(spec: str | None) -> tuple[tuple[str, str], ...]:
    """TOKEN=TENANT,TOKEN=TENANT -> ((token, tenant), ...)."""
    pairs = []
    for item in filter(None, (spec or "").split(",")):
        token, sep, tenant = item.strip().partition("=")
        if not sep or not token or not tenant:
            raise ValueError(f"tenant tokens: {item[:40]!r} must look like TOKEN=TENANT")
        pairs.append((token, tenant))
    return tuple(pairs)


def serve(args) -> int:
    token = args.token or env_token("CTXCACHE_TOKEN")
    tenants = tenant_tokens(args.tenant_tokens or env_token("CTXCACHE_TENANT_TOKENS"))
    loopback = args.host in ("127.0.0.1", "localhost", "::1")
    allow = args.allow_unauthenticated or env_switch("CTXCACHE_ALLOW_UNAUTHENTICATED")
    if not loopback and not (token or tenants) and not allow:
        raise ValueError(f"--host {args.host} is reachable by others: set CTXCACHE_TOKEN (and "
                         "CTXCACHE_TENANT_TOKENS), or pass --allow-unauthenticated (CTXCACHE_ALLOW_UNAUTHENTICATED=1)")
    if args.device.startswith("cuda"):
        import torch
        if not torch.cuda.is_available():
            raise ValueError(f"--device {args.device}: this torch ({torch.__version__}) sees no CUDA GPU")
    from ctxcache.service.server import create_server

    cfg = service_config(args, args.port, args.host, args.admin_port, token, (args.tls_cert, args.tls_key),
                         tenants)
    server, port = create_server(cfg)
    if args.metrics_port is not None:
        from prometheus_client import start_http_server
        start_http_server(args.metrics_port, addr=args.host, registry=server.metrics.registry)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    http = f", http {server.http_port}" if server.http is not None else ""
    print(f"ctxcache serving on {args.host}:{port} (admin {server.admin_port}{http}), model {cfg.model.model}, "
          f"store {cfg.store.path}, registry {server.backend.registry_kind}", flush=True)
    done.wait()
    print("draining...", flush=True)
    server.stop()
    return 0


def admin(args) -> int:
    from ctxcache.service.cli.admin import run_admin
    from ctxcache.service.cli.client import connect

    return run_admin(connect(args), args)


def demo(args) -> int:
    from ctxcache.service import demo_text
    from ctxcache.service.config import GiB, IndexerSettings, ModelConfig, ServerConfig, ServiceConfig, StoreSettings
    from ctxcache.service.server import create_server

    temp = None if args.data else tempfile.TemporaryDirectory(prefix="ctxcache-demo-")
    data = args.data or Path(temp.name)
    cfg = ServiceConfig(server=ServerConfig(port=0), model=ModelConfig(args.model),
                        store=StoreSettings(data, 2 * GiB), indexer=IndexerSettings(method=args.method))
    print(f"loading {args.model} and starting the service (store {data}) ...", flush=True)
    server, port = create_server(cfg)
    client = Client(f"127.0.0.1:{port}")
    try:
        t0 = time.perf_counter()
        info = client.put(pb.PutContextRequest(text=demo_text.TEXT, wait=True)).context
        print(f"PutContext: {info.context_id[:16]}... {pb.ContextState.Name(info.state)}, {info.n_tokens} tokens, "
              f"{info.artifact_bytes / 1e6:.1f} MB stored ({info.raw_kv_bytes / 1e6:.1f} MB raw KV), "
              f"{time.perf_counter() - t0:.1f}s")
        question = args.question or demo_text.QUESTION
        for attempt in ("first ask (loads the artifact)", "second ask (DRAM hit)"):
            print(f"\nQ ({attempt}): {question}\nA: ", end="", flush=True)
            req = pb.GenerateRequest(context_id=info.context_id, question=question,
                                     sampling=pb.SamplingParams(max_tokens=args.max_tokens))
            print(timings(stream_answer(client.generate(req))))
    finally:
        client.close()
        server.stop(1)
        if temp is not None:
            temp.cleanup()  # the demo leaves nothing behind
    return 0


def generate_local(args) -> int:
    from ctxcache.service.local import generate_local as run_local

    return run_local(args)


def _gib_or_none(gib: float | None) -> int | None:
    return None if gib is None else int(gib * (1 << 30))
