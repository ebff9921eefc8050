"""`ctxcache admin ...`: thin wrappers over AdminService / ContextService. Records print as JSON
with typed values in a stable order; `list` prints a table."""

from __future__ import annotations

import sys

from ctxcache.client import Client
from ctxcache.client.gen.v1 import admin_pb2 as apb, context_pb2 as pb
from ctxcache.service.cli.client import method_params
from ctxcache.service.cli.records import print_record as _print

_STATE = {pb.CONTEXT_STATE_BUILDING: "BUILDING", pb.CONTEXT_STATE_READY: "READY", pb.CONTEXT_STATE_FAILED: "FAILED",
          pb.CONTEXT_STATE_DAMAGED: "DAMAGED"}
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
        req = apb.EvictRequest(context_id=args.context_id, memory_only=args.memory_only, device_only=args.device_only,
                               local_only=args.local_only)
        resp = client.admin.Evict(req, metadata=md)
        _print(resp)
        if not resp.evicted:
            where = "on a device" if args.device_only else "cached"
            print(f"ctxcache: nothing evicted: {args.context_id} is not {where}", file=sys.stderr)
            return 1
    elif cmd == "rebuild":
        _rebuild(client, args)
    elif cmd == "verify":
        req = apb.VerifyRequest(context_id=args.context_id or "", repair=args.repair)
        resp = client.admin.Verify(req, metadata=md)
        _print(resp)
        return 0 if all(r.ok for r in resp.results) else 1
    elif cmd == "stats":
        _print(client.admin.Stats(apb.StatsRequest(), metadata=md))
    elif cmd == "reconcile":
        _print(client.admin.Reconcile(apb.ReconcileRequest(), metadata=md))
    return 0
