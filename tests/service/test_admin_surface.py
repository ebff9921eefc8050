"""What a benchmark or an operator reads from a running server without its code: a context's
stored bytes by part (Describe), the decode engines' step counts and held contexts (Stats), and a device-only
Evict that keeps the DRAM copy (the warm tier)."""

from __future__ import annotations

import grpc

from ctxcache.client.gen.v1 import admin_pb2 as apb
from ctxcache.service.cli import main as cli

from service_helpers import ask, put_text, rpc_code

ID0 = "0" * 64


def test_describe_splits_the_stored_bytes_by_part(start):
    _, client = start()
    info = put_text(client, keep_queries=True)
    got = client.admin.Describe(apb.DescribeRequest(context_id=info.context_id))
    parts = dict(got.stored_bytes_by_part)
    assert got.context.context_id == info.context_id and set(parts) == {"kv", "tables", "queries", "other"}
    assert sum(parts.values()) == info.artifact_bytes
    assert min(parts["kv"], parts["tables"], parts["queries"], parts["other"]) > 0
    assert rpc_code(lambda: client.admin.Describe(apb.DescribeRequest(context_id=ID0))) == grpc.StatusCode.NOT_FOUND


def test_stats_count_the_decode_steps_and_the_streams_they_stepped(start):
    _, client = start()
    cid = put_text(client).context_id
    before = client.admin.Stats(apb.StatsRequest())
    _, final = ask(client, cid, max_tokens=6)
    after = client.admin.Stats(apb.StatsRequest())
    steps, rows = after.decode_steps - before.decode_steps, after.decode_rows - before.decode_rows
    assert 0 < steps <= final.usage.generated_tokens and rows == steps  # one stream: a batch of one
    # no HBM or host slots on a CPU: every context decodes on the reference path
    assert (after.resident_contexts, after.offloaded_contexts, after.offload_hit_rate) == (0, 0, 0.0)


def test_device_only_evict_keeps_the_dram_copy(start):
    _, client = start()
    cid = put_text(client).context_id
    ask(client, cid)
    # the CPU reference runner holds the context's restored tables (shared by its streams):
    # released once, then nothing is left to release
    assert client.admin.Evict(apb.EvictRequest(context_id=cid, device_only=True)).evicted
    assert not client.admin.Evict(apb.EvictRequest(context_id=cid, device_only=True)).evicted
    assert client.admin.Stats(apb.StatsRequest()).dram_cache_entries == 1
    assert ask(client, cid)[1].timings.cache_hit


def test_cli_describe_and_device_only_evict(start, capsys):
    srv, client = start()
    cid, address = put_text(client).context_id, f"127.0.0.1:{srv.port}"
    assert cli.main(["admin", "--address", address, "describe", cid]) == 0
    assert '"stored_bytes_by_part"' in capsys.readouterr().out
    assert cli.main(["admin", "--address", address, "evict", "--device-only", cid]) == 1
    assert f"{cid} is not on a device" in capsys.readouterr().err
