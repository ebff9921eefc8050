"""`ctxcache admin ...`: thin wrappers over AdminService / ContextService, JSON out."""

from __future__ import annotations

import sys

from google.protobuf import json_format

from ctxcache.service.cli_commands import _params
from ctxcache.client import Client
from ctxcache.client.gen.v1 import admin_pb2 as apb, context_pb2 as pb


def _print(msg) -> None:
    """Every field, defaults included (a no-op shows evicted: false, not {})."""
    print(json_format.MessageToJson(msg, preserving_proto_field_name=True,
                                    always_print_fields_with_no_presence=True))


def run_admin(client: Client, args) -> int:
    md, cmd = client.metadata, args.admin_command
    if cmd == "list":
        token = ""
        while True:
            page = client.context.ListContexts(pb.ListContextsRequest(page_size=args.page_size, page_token=token),
                                               metadata=md)
            for c in page.contexts:
                print(f"{c.context_id}  {c.n_tokens:>7} tok  {c.artifact_bytes / 1e6:>9.1f} MB  {c.method:<12} "
                      f"{'pinned ' if c.pin else ''}{dict(c.labels) or ''}")
            token = page.next_page_token
            if not token:
                return 0
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
        req = apb.RebuildRequest(context_id=args.context_id, allow_reprefill=args.allow_reprefill, wait=True)
        req.method.name = args.method
        req.method.params.update(_params(args.params, "--params"))
        _print(client.admin.Rebuild(req, metadata=md))
    elif cmd == "verify":
        resp = client.admin.Verify(apb.VerifyRequest(context_id=args.context_id or ""), metadata=md)
        _print(resp)
        return 0 if all(r.ok for r in resp.results) else 1
    elif cmd == "stats":
        _print(client.admin.Stats(apb.StatsRequest(), metadata=md))
    elif cmd == "reconcile":
        _print(client.admin.Reconcile(apb.ReconcileRequest(), metadata=md))
    return 0
