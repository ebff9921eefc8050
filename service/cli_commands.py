"""What each `ctxcache` subcommand does (arguments come parsed from cli.py)."""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from google.protobuf import json_format

from ctxcache.client import Client
from ctxcache.service.config import (GiB, DecoderSettings, IndexerSettings, ModelConfig, RegistrySettings,
                                     ServerConfig, ServiceConfig, StoreSettings)
from ctxcache.service.config import FleetSettings
from ctxcache.client.gen.v1 import admin_pb2 as apb, context_pb2 as pb


def run(args) -> int:
    handler = {"serve": serve, "put": put, "generate": generate, "admin": admin, "demo": demo,
               "generate-local": generate_local}[args.command]
    return handler(args)  # errors become one line in cli.main


def service_config(args, port: int, host: str = "127.0.0.1", admin_port: int | None = None,
                   token: str | None = None, tls: tuple[Path | None, Path | None] = (None, None),
                   tenant_tokens: tuple[tuple[str, str], ...] = ()) -> ServiceConfig:
    return ServiceConfig(
        server=ServerConfig(host=host, port=port, admin_port=admin_port, max_streams=args.max_streams,
                            threads=max(64, args.max_streams + 16), auth_token=token,
                            tenant_tokens=tenant_tokens, tls_cert=tls[0], tls_key=tls[1],
                            grace_seconds=getattr(args, "grace", 5.0), advertise=getattr(args, "advertise", "")),
        model=ModelConfig(args.model, args.device, args.dtype),
        store=StoreSettings(args.data, int(args.store_budget_gb * GiB),
                            object_store_uri=getattr(args, "object_store", None)),
        registry=RegistrySettings(args.redis),
        indexer=IndexerSettings(method=args.method, store_queries=args.store_queries, kv_codec=args.kv_codec,
                                method_params=_params(getattr(args, "method_params", "{}"), "--method-params")),
        decoder=DecoderSettings(dram_cache_bytes=int(args.dram_cache_gb * GiB), schedule=args.schedule,
                                torch_threads=args.threads, max_batch=args.max_batch,
                                decode_mode=args.decode_mode, gpu_slot_tokens=args.gpu_slot_tokens,
                                offload=getattr(args, "offload", False),
                                **_gpu_slots(args)),
        fleet=FleetSettings(getattr(args, "role", "all"), getattr(args, "build_lease", 10.0),
                            getattr(args, "heartbeat", 2.0)))


def _gpu_slots(args) -> dict:
    """--gpu-slots or --gpu-memory-gb (never both): the fixed count, or the HBM that sizes it."""
    slots, memory = getattr(args, "gpu_slots", None), getattr(args, "gpu_memory_gb", None)
    if slots is not None and memory is not None:
        raise ValueError("give --gpu-slots or --gpu-memory-gb, not both (the memory decides the slots)")
    if memory is not None:
        if not memory > 0:
            raise ValueError(f"--gpu-memory-gb {memory} must be > 0")
        return {"gpu_memory_bytes": int(memory * GiB)}
    return {} if slots is None else {"gpu_slots": slots}


def _env_token(name: str) -> str | None:
    value = os.environ.get(name)
    if value is not None and not value.strip():
        raise ValueError(f"{name} is set but empty: unset it, or set it to a token")
    return value


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
    token = args.token or _env_token("CTXCACHE_TOKEN")
    tenants = tenant_tokens(args.tenant_tokens or _env_token("CTXCACHE_TENANT_TOKENS"))
    loopback = args.host in ("127.0.0.1", "localhost", "::1")
    if not loopback and not (token or tenants) and not args.allow_unauthenticated:
        raise ValueError(f"--host {args.host} is reachable by others: set CTXCACHE_TOKEN (and "
                         "CTXCACHE_TENANT_TOKENS), or pass --allow-unauthenticated")
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
    print(f"ctxcache serving on {args.host}:{port} (admin {server.admin_port}), model {cfg.model.model}, "
          f"store {cfg.store.path}, registry {server.backend.registry_kind}", flush=True)
    done.wait()
    print("draining...", flush=True)
    server.stop()
    return 0


def _client(args) -> Client:
    return Client(args.address, args.token or _env_token("CTXCACHE_TOKEN"), args.tls_ca, args.admin_address)


def put_request(args) -> pb.PutContextRequest:
    req = pb.PutContextRequest(ttl_seconds=args.ttl, pin=args.pin, wait=not args.no_wait, tenant=args.tenant,
                               kv_codec=args.kv_codec, keep_queries=args.keep_queries)
    for item in args.label:
        key, _, value = item.partition("=")
        req.labels[key] = value
    if args.method:
        req.method.name = args.method
        req.method.params.update(_params(args.params, "--params"))
    if args.text:
        req.text = args.text.read_text(encoding="utf-8")
    elif args.messages:
        messages = json.loads(args.messages.read_text(encoding="utf-8"))
        if not isinstance(messages, list):
            raise ValueError(f"--messages {args.messages}: must hold a JSON list of {{role, content}}")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"--messages {args.messages}: item {i} needs string fields 'role' and 'content'")
            req.chat.messages.add(role=m["role"], content=m["content"])
    else:
        for doc in read_documents(args.documents):
            req.documents.documents.add(**doc)
    return req


def _params(text: str, flag: str) -> dict:
    try:
        params = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag} is not JSON: {exc.msg} at column {exc.colno}") from None
    if not isinstance(params, dict):
        raise ValueError(f"{flag} must be a JSON object, e.g. '{{\"rerank\": 1}}'")
    return params


def read_documents(path: Path) -> list[dict[str, str]]:
    """Parquet (.parquet) or Arrow IPC file/stream: a `text` column, optional `id` and `title`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if path.suffix == ".parquet":
        table = pq.read_table(path)
    else:
        with pa.memory_map(str(path)) as source:
            try:
                table = pa.ipc.open_file(source).read_all()
            except pa.ArrowInvalid:
                table = pa.ipc.open_stream(pa.memory_map(str(path))).read_all()
    if "text" not in table.column_names:
        raise SystemExit(f"{path}: needs a `text` column, has {table.column_names}")
    rows = table.to_pylist()
    return [{k: str(r[k]) for k in ("id", "title", "text") if r.get(k) is not None} for r in rows]


def put(args) -> int:
    """Prints the context id (--json: the full record). Ctrl-C while waiting prints the id too:
    the build goes on on the server."""
    from tqdm import tqdm

    client = _client(args)
    req = put_request(args)
    wait, req.wait = req.wait, False
    info = client.put(req).context
    try:
        with tqdm(total=100, desc="build", unit="%", disable=not wait, file=sys.stderr) as bar:
            while wait and info.state == pb.CONTEXT_STATE_BUILDING:
                time.sleep(0.2)
                info = client.context.GetContext(pb.GetContextRequest(context_id=info.context_id),
                                                 metadata=client.metadata)
                bar.update(int(info.progress * 100) - bar.n)
    except KeyboardInterrupt:
        print(f"ctxcache: interrupted; the build goes on on the server: {info.context_id}", file=sys.stderr)
        print(info.context_id)
        return 130
    if args.json:
        print(json_format.MessageToJson(info, preserving_proto_field_name=True))
    else:
        print(info.context_id)
    if info.state == pb.CONTEXT_STATE_FAILED:
        print(f"ctxcache: error: build failed: {info.error}", file=sys.stderr)
        return 1
    return 0


def stream_answer(events, out=sys.stdout) -> pb.Final:
    final = None
    for ev in events:
        if ev.HasField("chunk"):
            out.write(ev.chunk.text)
            out.flush()
        else:
            final = ev.final
    out.write("\n")
    return final


def _timings(final: pb.Final) -> str:
    t, u = final.timings, final.usage
    return (f"[ttft {t.ttft_seconds:.3f}s, {t.tokens_per_second:.1f} tok/s, load {t.load_seconds:.3f}s "
            f"({'DRAM hit' if t.cache_hit else 'from store'}), cached {u.cached_tokens} + new "
            f"{u.new_prompt_tokens} prompt tokens, {u.generated_tokens} generated, "
            f"{pb.FinishReason.Name(final.finish_reason)}, decoded by {final.decode_path}]")


def generate(args) -> int:
    client = _client(args)
    s = pb.SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens)
    if args.seed is not None:
        s.seed = args.seed
    req = pb.GenerateRequest(context_id=args.context_id, question=args.question, sampling=s, stop=args.stop)
    final = stream_answer(client.generate(req))
    print(_timings(final), file=sys.stderr)
    return 0


def admin(args) -> int:
    from ctxcache.service.cli_admin import run_admin

    return run_admin(_client(args), args)


def demo(args) -> int:
    from ctxcache.service import demo_text
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
            print(_timings(stream_answer(client.generate(req))))
    finally:
        client.close()
        server.stop(1)
        if temp is not None:
            temp.cleanup()  # the demo leaves nothing behind
    return 0


def generate_local(args) -> int:
    from ctxcache.service.local import generate_local as run_local

    return run_local(args)
