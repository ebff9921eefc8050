"""`ctxcache admin ...`: thin wrappers over AdminService / ContextService. Records print as JSON
with typed values in a stable order; `list` prints a table."""

from __future__ import annotations

import base64
import json
import sys
from typing import Any

from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor as F
from google.protobuf.message import Message

from ctxcache.client import Client
from ctxcache.client.gen.v1 import admin_pb2 as apb, context_pb2 as pb
from ctxcache.service.cli_client import method_params


def plain(msg: Message) -> dict[str, Any]:
    """A message as JSON values for people: fields in declaration order, defaults included (a
    no-op shows evicted: false, not {}), a message field only when set; integers as numbers
    (proto3 JSON writes 64-bit ones as strings), float32 at its precision, enums by name,
    method parameters that are whole numbers as integers (a Struct holds only doubles), map and
    Struct keys sorted."""
    out = {}
    for f in msg.DESCRIPTOR.fields:
        if f.has_presence and not f.is_repeated and not msg.HasField(f.name):
            continue
        out[f.name] = _field(getattr(msg, f.name), f)
    return out


def _field(value: Any, f: F) -> Any:
    entry = f.message_type
    if entry is not None and entry.GetOptions().map_entry:
        vf = entry.fields_by_name["value"]
        return {k: _one(value[k], vf) for k in sorted(value)}
    if f.is_repeated:
        return [_one(v, f) for v in value]
    return _one(value, f)


def _one(value: Any, f: F) -> Any:
    if f.type == F.TYPE_MESSAGE:
        if f.message_type.full_name == "google.protobuf.Struct":
            return _whole(json_format.MessageToDict(value))
        return plain(value)
    if f.type == F.TYPE_ENUM:
        known = f.enum_type.values_by_number.get(value)
        return known.name if known is not None else value
    if f.type == F.TYPE_FLOAT:
        return float(f"{value:.7g}")  # float32: 0.3, not 0.30000001192092896
    if f.type == F.TYPE_BYTES:
        return base64.b64encode(value).decode()
    return value


def _whole(x: Any) -> Any:
    if isinstance(x, float) and x.is_integer() and abs(x) < 2 ** 53:
        return int(x)
    if isinstance(x, dict):
        return {k: _whole(x[k]) for k in sorted(x)}
    if isinstance(x, list):
        return [_whole(v) for v in x]
    return x


def _print(msg: Message) -> None:
    print(json.dumps(plain(msg), indent=2))


_STATE = {pb.CONTEXT_STATE_BUILDING: "BUILDING", pb.CONTEXT_STATE_READY: "READY", pb.CONTEXT_STATE_FAILED: "FAILED"}
HEADER = f"{'CONTEXT ID':<64}  {'STATE':<13} {'TOKENS':>7}  {'STORED MB':>9}  {'METHOD':<12} {'CODEC':<8} LABELS"


def list_row(c: pb.ContextInfo) -> str:
    state = _STATE.get(c.state, "UNKNOWN")
    if c.state == pb.CONTEXT_STATE_BUILDING:
        state += f" {c.progress:.0%}"
    stored = f"{c.artifact_bytes / 1e6:9.1f}" if c.state == pb.CONTEXT_STATE_READY else f"{'-':>9}"
    labels = ",".join(f"{k}={c.labels[k]}" for k in sorted(c.labels))
    pin = "pinned " if c.pin else ""
    return f"{c.context_id:<64}  {state:<13} {c.n_tokens:>7}  {stored}  {c.method:<12} {c.kv_codec:<8} {pin}{labels}"


def _list(client: Client, page_size: int) -> int:
    token, first = "", True
    while True:
        page = client.context.ListContexts(pb.ListContextsRequest(page_size=page_size, page_token=token),
                                           metadata=client.metadata)
        if first:
            print(HEADER)
            first = False
        for c in page.contexts:
            print(list_row(c))
        token = page.next_page_token
        if not token:
            return 0


def _rebuild(client: Client, args) -> None:
    req = apb.RebuildRequest(context_id=args.context_id, allow_reprefill=args.allow_reprefill, wait=True)
    req.method.name = args.method  # empty: the context's own method (its parameters, these over them)
    req.method.params.update(method_params(args.params, "--params"))
    _print(client.admin.Rebuild(req, metadata=client.metadata))


def run_admin(client: Client, args) -> int:
    md, cmd = client.metadata, args.admin_command
    if cmd == "list":
        return _list(client, args.page_size)
    if cmd == "show":
        _print(client.context.GetContext(pb.GetContextRequest(context_id=args.context_id), metadata=md))
    elif cmd == "describe":
        _print(client.admin.Describe(apb.DescribeRequest(context_id=args.context_id), metadata=md))
    elif cmd == "evict":
        req = apb.EvictRequest(context_id=args.context_id, memory_only=args.memory_only, device_only=args.device_only)
        resp = client.admin.Evict(req, metadata=md)
        _print(resp)
        if not resp.evicted:
            where = "on a device" if args.device_only else "cached"
            print(f"ctxcache: nothing evicted: {args.context_id} is not {where}", file=sys.stderr)
            return 1
    elif cmd == "rebuild":
        _rebuild(client, args)
    elif cmd == "verify":
        resp = client.admin.Verify(apb.VerifyRequest(context_id=args.context_id or ""), metadata=md)
        _print(resp)
        return 0 if all(r.ok for r in resp.results) else 1
    elif cmd == "stats":
        _print(client.admin.Stats(apb.StatsRequest(), metadata=md))
    elif cmd == "reconcile":
        _print(client.admin.Reconcile(apb.ReconcileRequest(), metadata=md))
    return 0
