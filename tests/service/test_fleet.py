"""Issue 33: a fleet of real `ctxcache serve` processes on one redis-server and one S3 server
(SeaweedFS): two indexers, two decoders, and one `--role all` node (no Redis, no object store)
as the reference (the `fleet` fixture, fleet_procs.py). Here what a fleet does when its parts
work; test_fleet_faults.py: damaged objects, a stopped Redis or object store."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import redis

from ctxcache.client.gen.v1 import admin_pb2 as apb, context_pb2 as pb
from ctxcache.client.routing import RoutedClient, home
from ctxcache.store.registries.fleet_registry import FleetState, claim_key, ctx_key

from fleet_procs import (ADMIN_TOKEN, SLOW_TEXT, TEXT, Worker, builds, fleet, get,  # noqa: F401 (fixture)
                         put, tokens, wait_until)
from service_helpers import rpc_code

pytestmark = [pytest.mark.redis, pytest.mark.s3, pytest.mark.timeout(300)]


def test_put_on_one_decoder_generate_on_another_gives_the_single_nodes_tokens(fleet):
    info = put(fleet.a).context
    assert info.state == pb.CONTEXT_STATE_READY
    on_b = get(fleet.b, info.context_id)  # b never saw the context
    assert on_b.state == pb.CONTEXT_STATE_READY and on_b.artifact_uri
    reference = put(fleet.one).context  # one node, no Redis, no object store
    assert reference.context_id == info.context_id
    assert tokens(fleet.b, info.context_id) == tokens(fleet.one, info.context_id)
    assert len(tokens(fleet.b, info.context_id)) == 8


def test_get_context_shows_the_workers_holding_it_hot_and_the_client_routes_there(fleet):
    cid = put(fleet.a, TEXT + " hot").context.context_id
    routed = RoutedClient([fleet.a.address, fleet.b.address], ADMIN_TOKEN)
    assert list(get(fleet.a, cid).hot_workers) == []
    assert routed.route(cid) == home(cid, [fleet.a.address, fleet.b.address])  # cold: its home decoder
    tokens(fleet.b, cid)
    assert wait_until(lambda: list(get(fleet.a, cid).hot_workers) == [fleet.b.address], 2.0)
    assert routed.route(cid) == fleet.b.address
    routed.close()
    c = fleet.b.client()
    c.admin.Evict(apb.EvictRequest(context_id=cid, memory_only=True), metadata=c.metadata)
    c.close()
    assert wait_until(lambda: list(get(fleet.a, cid).hot_workers) == [], 2.0)


def test_the_same_text_from_two_callers_on_two_decoders_is_one_build(fleet):
    before = sum(builds(ix, "ready") for ix in fleet.indexers)
    text, barrier, out = TEXT + " raced", threading.Barrier(2), {}

    def call(worker: Worker) -> None:
        barrier.wait()
        out[worker.name] = put(worker, text)

    threads = [threading.Thread(target=call, args=(w,)) for w in (fleet.a, fleet.b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    a, b = out["decA"], out["decB"]
    assert a.context.context_id == b.context.context_id
    assert a.context.state == b.context.state == pb.CONTEXT_STATE_READY
    assert sorted([a.created, b.created]) == [False, True]
    assert sum(builds(ix, "ready") for ix in fleet.indexers) == before + 1


def test_an_indexer_only_builds(fleet):
    assert rpc_code(lambda: put(fleet.indexers[0])) == grpc.StatusCode.FAILED_PRECONDITION
    assert rpc_code(lambda: tokens(fleet.indexers[0], "0" * 64)) == grpc.StatusCode.FAILED_PRECONDITION


def test_progress_and_delete_of_a_building_context_cross_processes(fleet):
    cancelled = sum(builds(ix, "cancelled") for ix in fleet.indexers)
    info = put(fleet.a, SLOW_TEXT + " deleted while building", wait=False, slow=True).context
    assert info.state == pb.CONTEXT_STATE_BUILDING
    seen = wait_until(lambda: get(fleet.b, info.context_id).progress >= 0.7, 60)  # the indexer's progress, on b
    assert seen, get(fleet.b, info.context_id)
    c = fleet.b.client()
    assert c.context.DeleteContext(pb.DeleteContextRequest(context_id=info.context_id), metadata=c.metadata).deleted
    c.close()
    assert wait_until(lambda: sum(builds(ix, "cancelled") for ix in fleet.indexers) == cancelled + 1, 5)
    assert rpc_code(lambda: get(fleet.a, info.context_id)) == grpc.StatusCode.NOT_FOUND
    # the indexer is free again at once: a new build is done in well under the cancelled one's time
    t0 = time.monotonic()
    assert put(fleet.a, TEXT + " after the cancel").context.state == pb.CONTEXT_STATE_READY
    assert time.monotonic() - t0 < 10


def test_delete_on_one_decoder_is_not_found_on_every_decoder_within_a_second(fleet):
    cid = put(fleet.a, TEXT + " to delete").context.context_id
    tokens(fleet.a, cid), tokens(fleet.b, cid)  # hot on both
    cb = fleet.b.client()
    in_dram = cb.admin.Stats(apb.StatsRequest(), metadata=cb.metadata).dram_cache_entries
    c = fleet.a.client()
    t0 = time.monotonic()
    assert c.context.DeleteContext(pb.DeleteContextRequest(context_id=cid), metadata=c.metadata).deleted
    c.close()
    for w in (fleet.a, fleet.b):
        assert rpc_code(lambda: tokens(w, cid)) == grpc.StatusCode.NOT_FOUND
        assert rpc_code(lambda: get(w, cid)) == grpc.StatusCode.NOT_FOUND
    assert time.monotonic() - t0 < 1.0
    # and b dropped its DRAM copy (the delete event)
    assert wait_until(lambda: cb.admin.Stats(apb.StatsRequest(), metadata=cb.metadata).dram_cache_entries
                      == in_dram - 1, 1.0)
    cb.close()


def test_tenants_are_isolated_across_workers(fleet):
    cid = put(fleet.a, TEXT + " alpha's", token="alpha-token").context.context_id
    assert rpc_code(lambda: get(fleet.b, cid, token="beta-token")) == grpc.StatusCode.NOT_FOUND
    assert rpc_code(lambda: tokens(fleet.b, cid, token="beta-token")) == grpc.StatusCode.NOT_FOUND
    c = fleet.b.client("beta-token")
    listed = c.context.ListContexts(pb.ListContextsRequest(), metadata=c.metadata).contexts
    deleted = c.context.DeleteContext(pb.DeleteContextRequest(context_id=cid), metadata=c.metadata).deleted
    c.close()
    assert cid not in [x.context_id for x in listed] and not deleted
    assert len(tokens(fleet.b, cid, token="alpha-token")) == 8


def rebuild(worker: Worker, cid: str) -> apb.RebuildResponse:
    """To a query-built method with new parameters: from the stored query sample, no prefill."""
    c = worker.client()
    req = apb.RebuildRequest(context_id=cid, wait=True,
                             method=pb.MethodSpec(name="csattention", params={"subspaces": 4, "centroids": 8}))
    try:
        return c.admin.Rebuild(req, metadata=c.metadata, timeout=120)
    finally:
        c.close()


def test_rebuild_on_a_decoder_reindexes_on_an_indexer_like_one_node(fleet):
    before = sum(builds(ix, "ready") for ix in fleet.indexers)
    cid = put(fleet.a, TEXT + " rebuilt", keep_queries=True).context.context_id
    on_b = rebuild(fleet.b, cid)  # the job names cid; an indexer reads its K/V from the object store
    assert on_b.context.state == pb.CONTEXT_STATE_READY and not on_b.reprefilled, on_b.context.error
    assert sum(builds(ix, "ready") for ix in fleet.indexers) == before + 2  # the put and the re-index
    assert put(fleet.one, TEXT + " rebuilt", keep_queries=True).context.context_id == cid
    reference = rebuild(fleet.one, cid)
    assert reference.context.context_id == on_b.context.context_id != cid
    assert tokens(fleet.a, on_b.context.context_id) == tokens(fleet.one, on_b.context.context_id)


def test_an_indexer_reconciles_the_registry_with_the_object_store_at_start(fleet):
    registry, r = fleet.registry(), redis.Redis.from_url(fleet.redis.url, decode_responses=True)
    unlisted = put(fleet.a, TEXT + " unlisted").context.context_id
    registry.drop(unlisted)  # an artifact with no entry (e.g. Redis restarted empty)
    gone, lost, held = "b" * 64, "c" * 64, "d" * 64
    r.hset(ctx_key(gone), mapping={"state": "READY", "uri": "s3://nowhere", "updated_at": 1.0})  # no object
    r.hset(ctx_key(lost), mapping={"state": "BUILDING", "job_id": "lost-job", "updated_at": 1.0})  # no job, claim
    r.hset(ctx_key(held), mapping={"state": "BUILDING", "job_id": "held-job", "updated_at": 1.0})
    r.set(claim_key(held), "held-job", px=60_000)  # a build someone holds: left alone
    ix = Worker("ix-reconcile", fleet.root, "indexer", fleet.redis.url, fleet.s3.uri(prefix="fleet")).start()
    try:
        ix.wait_serving()
        def states() -> tuple:
            return tuple(f.state if f else None for f in map(registry.facts, (unlisted, gone, lost, held)))

        want = (FleetState.READY, None, FleetState.FAILED, FleetState.BUILDING)
        assert wait_until(lambda: states() == want, 30), (states(), ix.log()[-2000:])
        assert len(tokens(fleet.b, unlisted)) == 8
    finally:
        ix.stop()
        r.delete(ctx_key(lost), ctx_key(held), claim_key(held))
        r.close()
        registry.close()


def test_an_indexer_collects_the_object_stores_garbage_and_tombstones_what_expired(fleet):
    from pyarrow import fs

    registry = fleet.registry()
    expired = put(fleet.a, TEXT + " expires", ttl_seconds=1).context.context_id
    s3fs = fs.S3FileSystem(endpoint_override=fleet.s3.endpoint, scheme="http", anonymous=True)
    root = "ctxcache/fleet/v1"
    orphan = f"{root}/chunks/{'e' * 64}.{'0' * 20}/ctx.tokens"  # a dead writer's chunk, no manifest
    with s3fs.open_output_stream(orphan) as f:
        f.write(b"x" * 1000)

    def there(path: str) -> bool:
        return s3fs.get_file_info(path).type == fs.FileType.File

    assert there(orphan) and there(f"{root}/manifests/{expired}")
    time.sleep(1.5)  # the TTL and the grace pass
    ix = Worker("ix-gc", fleet.root, "indexer", fleet.redis.url, fleet.s3.uri(prefix="fleet"),
                "--gc-interval", "0.5", "--gc-grace", "1").start()
    try:
        ix.wait_serving()
        assert wait_until(lambda: not there(orphan), 30), ix.log()[-2000:]
        assert not there(f"{root}/manifests/{expired}")
        # every decoder drops its copies: the GC tombstones the expired id after its object-store pass
        # (between the two the start's reconcile may have removed the stale entry: no facts yet)
        def tombstoned() -> bool:
            facts = registry.facts(expired)
            return facts is not None and facts.state == FleetState.DELETED
        assert wait_until(tombstoned, 10), (registry.facts(expired), ix.log()[-2000:])
        assert rpc_code(lambda: get(fleet.b, expired)) == grpc.StatusCode.NOT_FOUND
    finally:
        ix.stop()
        registry.close()


def test_kill9_of_the_building_indexer_another_finishes_and_the_put_succeeds(fleet):
    text, out = SLOW_TEXT + " survives a kill -9", {}
    waiter = threading.Thread(target=lambda: out.update(r=put(fleet.a, text, slow=True)))
    waiter.start()
    registry = fleet.registry()
    by_address = {ix.address: ix for ix in fleet.indexers}

    def building():
        for f in registry.entries():
            if f.state == FleetState.BUILDING and f.indexer and f.progress >= 0.7:
                return f
        return None

    f = wait_until(building, 60)
    assert f is not None, "no build reached 0.7"
    victim = by_address[f.indexer]
    victim.kill()
    waiter.join(120)
    info = out["r"].context
    assert info.state == pb.CONTEXT_STATE_READY, info.error
    after = registry.facts(info.context_id)
    assert after.attempts == 2 and after.indexer != victim.address
    assert len(tokens(fleet.b, info.context_id)) == 8
    registry.close()
    fleet.indexers.remove(victim)
