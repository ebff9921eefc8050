"""The client subcommands (`put`, `generate`, `health`): they talk to a running server and
import no torch, so a command against no server fails in about the time Python starts."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from ctxcache.client import Client
from ctxcache.client.gen.v1 import context_pb2 as pb
from ctxcache.service.cli.records import print_record

READY_TIMEOUT_S = 2.0  # a server that is not running is reported after this, not gRPC's backoff


def env_token(name: str) -> str | None:
    value = os.environ.get(name)
    if value is not None and not value.strip():
        raise ValueError(f"{name} is set but empty: unset it, or set it to a token")
    return value


def connect(args) -> Client:
    """A client whose channels are connected (ConnectionError naming the address otherwise)."""
    client = Client(args.address, args.token or env_token("CTXCACHE_TOKEN"), args.tls_ca, args.admin_address)
    client.wait_ready(READY_TIMEOUT_S)
    return client


def method_params(text: str, flag: str) -> dict:
    try:
        params = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag} is not JSON: {exc.msg} at column {exc.colno} (e.g. '{{\"rerank\": 1}}')") from None
    if not isinstance(params, dict):
        raise ValueError(f"{flag} must be a JSON object, e.g. '{{\"rerank\": 1}}'")
    return params


def put_request(args) -> pb.PutContextRequest:
    req = pb.PutContextRequest(ttl_seconds=args.ttl, pin=args.pin, wait=not args.no_wait, tenant=args.tenant,
                               kv_codec=args.kv_codec, keep_queries=args.keep_queries)
    for item in args.label:
        key, _, value = item.partition("=")
        req.labels[key] = value
    req.method.name = args.method  # empty: the server's default method, these parameters over its own
    req.method.params.update(method_params(args.params, "--params"))
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


# the bar counts percent of the build; a rate of percent per second means nothing to a reader
BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| [{elapsed} elapsed, {remaining} left]"


def put(args) -> int:
    """Prints the context id (--json: the full record). Ctrl-C while waiting prints the id too:
    the build goes on on the server."""
    from tqdm import tqdm

    req = put_request(args)  # bad flags and files are reported before any connection
    client = connect(args)
    wait, req.wait = req.wait, False
    info = client.put(req).context
    try:
        with tqdm(total=100, desc="build", bar_format=BAR_FORMAT, disable=not wait, file=sys.stderr) as bar:
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
        print_record(info)
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


def timings(final: pb.Final) -> str:
    t, u = final.timings, final.usage
    return (f"[ttft {t.ttft_seconds:.3f}s, {t.tokens_per_second:.1f} tok/s, load {t.load_seconds:.3f}s "
            f"({'DRAM hit' if t.cache_hit else 'from store'}), cached {u.cached_tokens} + new "
            f"{u.new_prompt_tokens} prompt tokens, {u.generated_tokens} generated, "
            f"{pb.FinishReason.Name(final.finish_reason)}, decoded by {final.decode_path}]")


def generate(args) -> int:
    s = pb.SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens)
    if args.seed is not None:
        s.seed = args.seed
    req = pb.GenerateRequest(context_id=args.context_id, question=args.question, sampling=s, stop=args.stop)
    final = stream_answer(connect(args).generate(req))
    print(timings(final), file=sys.stderr)
    return 0


def health(args) -> int:
    """Exit 0 when the server's grpc.health.v1 service says SERVING (a container healthcheck)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    client = connect(args)
    status = health_pb2_grpc.HealthStub(client.channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    print(name)
    return 0 if status == health_pb2.HealthCheckResponse.SERVING else 1
