"""Issue 33: a fleet of real `ctxcache serve` processes on one redis-server and one S3 server
(SeaweedFS): two indexers, two decoders, and one `--role all` node (no Redis, no object store)
as the reference. Tests that stop a shared part (Redis, the object store) come last."""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import redis

from ctxcache.client.gen.v1 import admin_pb2 as apb, context_pb2 as pb
from ctxcache.client.routing import RoutedClient, home
from ctxcache.service.cli import main as cli
from ctxcache.store.registries.fleet_registry import FleetRegistry, FleetState, claim_key, ctx_key

from fleet_procs import ADMIN_TOKEN, Worker, start_all, stop_all
from redis_server import RedisServer, free_port, redis_binary
from s3_server import S3Server, weed_binary

pytestmark = [pytest.mark.redis, pytest.mark.s3, pytest.mark.timeout(300)]
TEXT = "The harbour of Port Averel has a lighthouse on a granite spur called the Needle. " * 3
# CSAttention with 16 subspaces x 1024 centroids and 100 k-means iterations over ~700 tokens
# (random:tiny caches at most 768): ~2.5 s per layer on a 2-core CPU, so a build seen at 0.7
# (indexing) still has seconds to go when the delete or kill reaches it; key-kmeans with one key
# per cluster indexed both layers in ~0.4 s, and CI saw such a build finish before the delete
SLOW_METHOD, SLOW = "csattention", {"subspaces": 16, "centroids": 1024, "kmeans_iters": 100}
SLOW_TEXT = (TEXT * 3)[:680]


@dataclass
class Fleet:
    redis: RedisServer
    s3: S3Server
    indexers: list[Worker]
    a: Worker
    b: Worker
    one: Worker  # --role all: the single-node reference
    root: Path

    def registry(self) -> FleetRegistry:
        return FleetRegistry(self.redis.config())


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    if redis_binary() is None or weed_binary() is None:
        pytest.skip("needs redis-server and SeaweedFS's weed")
    root = tmp_path_factory.mktemp("fleet")
    redis, s3 = RedisServer(redis_binary(), root), S3Server(weed_binary(), root / "s3")
    redis.start()
    store = s3.uri(prefix="fleet")
    indexers = [Worker(f"ix{i}", root, "indexer", redis.url, store, "--metrics-port", str(free_port()))
                for i in (1, 2)]
    a = Worker("decA", root, "decoder", redis.url, store, "--http-port", "0")  # the HTTP front on a fleet decoder
    b = Worker("decB", root, "decoder", redis.url, store)
    one = Worker("one", root, "all", None, None)
    workers = start_all([*indexers, a, b, one], meanwhile=s3.start)  # no worker touches S3 before a Put
    try:
        yield Fleet(redis, s3, indexers, a, b, one, root)
    finally:
        stop_all(workers)
        redis.stop()
        s3.stop()


def put(worker: Worker, text: str = TEXT, token: str | None = None, wait: bool = True, slow: bool = False,
        **kw) -> pb.PutContextResponse:
    c = worker.client(token) if token else worker.client()
    req = pb.PutContextRequest(text=text, wait=wait, **kw)
    if slow:
        req.method.name = SLOW_METHOD
        req.method.params.update(SLOW)
    try:
        return c.put(req, timeout=120)
    finally:
        c.close()


def get(worker: Worker, cid: str, token: str | None = None) -> pb.ContextInfo:
    c = worker.client(token) if token else worker.client()
    try:
        return c.context.GetContext(pb.GetContextRequest(context_id=cid), metadata=c.metadata, timeout=10)
    finally:
        c.close()


def tokens(worker: Worker, cid: str, token: str | None = None, max_tokens: int = 8, timeout: float = 60,
           seen: list | None = None) -> list[int]:
    """The greedy answer's token ids; `seen` collects the stream's messages as they arrive."""
    c = worker.client(token) if token else worker.client()
    req = pb.GenerateRequest(context_id=cid, question="Where is the lighthouse?",
                             sampling=pb.SamplingParams(max_tokens=max_tokens))
    events = [] if seen is None else seen
    try:
        for e in c.generate(req, timeout=timeout):
            events.append(e)
    finally:
        c.close()
    assert events[-1].HasField("final")
    return [t for e in events if e.HasField("chunk") for t in e.chunk.token_ids]


def code_of(fn) -> grpc.StatusCode | None:
    try:
        fn()
    except grpc.RpcError as err:
        return err.code()
    return None


def builds(indexer: Worker, outcome: str) -> int:
    """The indexer's own count of builds by outcome (its Prometheus endpoint)."""
    port = indexer.args[indexer.args.index("--metrics-port") + 1]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    m = re.search(rf'^ctxcache_builds_total{{outcome="{outcome}"}} ([0-9.]+)$', text, re.MULTILINE)
    return int(float(m.group(1))) if m else 0


def failure(fn) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        fn()
    return err.value


def assert_no_address(err: grpc.RpcError, part: str, *addresses: str) -> None:
    """A tenant reads which part failed, never where it lives (issue 43)."""
    assert part in err.details(), err.details()
    for address in addresses:
        assert address not in err.details(), err.details()
    assert "127.0.0.1" not in err.details(), err.details()


def wait_until(predicate, timeout_s: float, step_s: float = 0.02):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step_s)
    return predicate()


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
    assert code_of(lambda: put(fleet.indexers[0])) == grpc.StatusCode.FAILED_PRECONDITION
    assert code_of(lambda: tokens(fleet.indexers[0], "0" * 64)) == grpc.StatusCode.FAILED_PRECONDITION


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
    assert code_of(lambda: get(fleet.a, info.context_id)) == grpc.StatusCode.NOT_FOUND
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
        assert code_of(lambda: tokens(w, cid)) == grpc.StatusCode.NOT_FOUND
        assert code_of(lambda: get(w, cid)) == grpc.StatusCode.NOT_FOUND
    assert time.monotonic() - t0 < 1.0
    # and b dropped its DRAM copy (the delete event)
    assert wait_until(lambda: cb.admin.Stats(apb.StatsRequest(), metadata=cb.metadata).dram_cache_entries
                      == in_dram - 1, 1.0)
    cb.close()


def test_tenants_are_isolated_across_workers(fleet):
    cid = put(fleet.a, TEXT + " alpha's", token="alpha-token").context.context_id
    assert code_of(lambda: get(fleet.b, cid, token="beta-token")) == grpc.StatusCode.NOT_FOUND
    assert code_of(lambda: tokens(fleet.b, cid, token="beta-token")) == grpc.StatusCode.NOT_FOUND
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
        assert registry.facts(expired).state == FleetState.DELETED  # every decoder drops its copies
        assert code_of(lambda: get(fleet.b, expired)) == grpc.StatusCode.NOT_FOUND
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


def damage(s3: S3Server, cid: str, how: str) -> str:
    """Corrupt (flip bytes, same size) or truncate (half) the largest stored object of cid."""
    from pyarrow import fs

    s3fs = fs.S3FileSystem(endpoint_override=s3.endpoint, scheme="http", anonymous=True)
    infos = s3fs.get_file_info(fs.FileSelector("ctxcache/fleet/v1/chunks", recursive=True))
    victim = max((i for i in infos if cid in i.path and i.type == fs.FileType.File), key=lambda i: i.size)
    with s3fs.open_input_stream(victim.path) as f:
        data = bytearray(f.read())
    if how == "truncate":
        data = data[:len(data) // 2]
    else:
        data[len(data) // 2:len(data) // 2 + 16] = bytes(b ^ 0xFF for b in data[len(data) // 2:len(data) // 2 + 16])
    with s3fs.open_output_stream(victim.path) as f:
        f.write(bytes(data))
    return victim.path


@pytest.mark.parametrize("how", ["corrupt", "truncate"])
def test_a_damaged_object_is_data_loss_before_any_token(fleet, how):
    cid = put(fleet.a, TEXT + f" to {how}").context.context_id
    damage(fleet.s3, cid, how)
    seen: list = []
    with pytest.raises(grpc.RpcError) as err:
        tokens(fleet.b, cid, seen=seen)  # b has no copy: a cold load from the object store
    assert err.value.code() == grpc.StatusCode.DATA_LOSS and seen == []


def test_the_http_front_on_a_fleet_decoder_builds_on_an_indexer_and_answers_as_grpc(fleet):
    import httpx

    base, auth = f"http://127.0.0.1:{fleet.a.http_port}", {"Authorization": "Bearer alpha-token"}
    assert fleet.a.http_port
    with httpx.Client(base_url=base, headers=auth, timeout=120) as http:
        made = http.post("/v1/cached_contents", json={"text": TEXT + " over HTTP", "wait": True}).json()
        assert made["state"] == "READY", made
        registry = fleet.registry()
        facts = registry.facts(made["id"])
        registry.close()
        assert facts.indexer in {ix.address for ix in fleet.indexers}  # an indexer built it
        body = {"model": "random:tiny", "cached_content": made["id"], "max_tokens": 8, "temperature": 0,
                "messages": [{"role": "user", "content": "Where is the lighthouse?"}], "return_token_ids": True}
        answer = http.post("/v1/chat/completions", json=body).json()
        assert answer["choices"][0]["token_ids"] == tokens(fleet.b, made["id"], token="alpha-token")
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == facts.n_tokens
        assert http.get(f"/v1/cached_contents/{made['id']}").json()["state"] == "READY"
        assert http.delete(f"/v1/cached_contents/{made['id']}").status_code == 200
    assert code_of(lambda: get(fleet.b, made["id"])) == grpc.StatusCode.NOT_FOUND  # deleted fleet-wide


def damage_manifest(s3: S3Server, cid: str) -> None:
    """Flip one byte in the middle of cid's manifest (its checksum then fails)."""
    from pyarrow import fs

    s3fs = fs.S3FileSystem(endpoint_override=s3.endpoint, scheme="http", anonymous=True)
    path = f"ctxcache/fleet/v1/manifests/{cid}"
    with s3fs.open_input_stream(path) as f:
        data = bytearray(f.read())
    data[len(data) // 2] ^= 0x01
    with s3fs.open_output_stream(path) as f:
        f.write(bytes(data))


def listed(worker: Worker, token: str | None = None) -> dict[str, pb.ContextInfo]:
    c = worker.client(token) if token else worker.client()
    try:
        page = c.context.ListContexts(pb.ListContextsRequest(page_size=1000), metadata=c.metadata, timeout=10)
    finally:
        c.close()
    return {i.context_id: i for i in page.contexts}


def test_a_damaged_manifest_is_damaged_reconcile_skips_it_and_a_put_rebuilds_it(fleet):
    text = TEXT + " whose manifest is damaged"
    cid = put(fleet.a, text, token="alpha-token").context.context_id
    expected = tokens(fleet.one, put(fleet.one, text, token="alpha-token").context.context_id, token="alpha-token")
    damage_manifest(fleet.s3, cid)
    info = get(fleet.b, cid, token="alpha-token")  # the tenant sees it, with what failed
    assert info.state == pb.CONTEXT_STATE_DAMAGED and "manifest" in info.error
    assert code_of(lambda: get(fleet.b, cid, token="beta-token")) == grpc.StatusCode.NOT_FOUND
    c = fleet.a.client()
    try:
        done = c.admin.Reconcile(apb.ReconcileRequest(), metadata=c.metadata, timeout=30)
    finally:
        c.close()
    assert cid in done.damaged  # skipped and reported, not the whole reconcile failed
    assert listed(fleet.b)[cid].state == pb.CONTEXT_STATE_DAMAGED  # `admin list`
    assert listed(fleet.a, "alpha-token")[cid].state == pb.CONTEXT_STATE_DAMAGED
    assert cid not in listed(fleet.a, "beta-token")
    again = put(fleet.b, text, token="alpha-token")
    assert again.created and again.context.state == pb.CONTEXT_STATE_READY, again.context.error
    assert tokens(fleet.b, cid, token="alpha-token") == expected
    assert get(fleet.a, cid).state == pb.CONTEXT_STATE_READY


@pytest.mark.parametrize("how", ["delete", "evict"])
def test_a_damaged_manifest_is_deleted_and_evicted_through_the_api(fleet, how):
    cid = put(fleet.a, TEXT + f" damaged, then {how}d").context.context_id
    damage_manifest(fleet.s3, cid)
    c = fleet.b.client()
    try:
        if how == "delete":
            assert c.context.DeleteContext(pb.DeleteContextRequest(context_id=cid), metadata=c.metadata).deleted
        else:
            assert c.admin.Evict(apb.EvictRequest(context_id=cid), metadata=c.metadata).evicted
    finally:
        c.close()
    assert code_of(lambda: get(fleet.a, cid)) == grpc.StatusCode.NOT_FOUND
    assert put(fleet.a, TEXT + f" damaged, then {how}d").created  # built anew


def test_a_damaged_chunk_is_damaged_after_a_failed_load_and_a_put_rebuilds_it(fleet):
    text = TEXT + " whose chunk is damaged"
    cid = put(fleet.a, text).context.context_id
    expected = tokens(fleet.one, put(fleet.one, text).context.context_id)
    damage(fleet.s3, cid, "corrupt")
    assert code_of(lambda: tokens(fleet.b, cid)) == grpc.StatusCode.DATA_LOSS  # b has no copy: a cold load
    info = get(fleet.a, cid)
    assert info.state == pb.CONTEXT_STATE_DAMAGED and "chunk" in info.error
    again = put(fleet.a, text)
    assert again.created and again.context.state == pb.CONTEXT_STATE_READY, again.context.error
    assert tokens(fleet.b, cid) == expected


def test_verify_repair_marks_a_damaged_chunk_damaged(fleet):
    text = TEXT + " verified"
    cid = put(fleet.a, text).context.context_id
    damage(fleet.s3, cid, "truncate")
    c = fleet.b.client()
    try:
        plain = c.admin.Verify(apb.VerifyRequest(context_id=cid), metadata=c.metadata, timeout=30).results[0]
        assert not plain.ok and not plain.marked_damaged
        assert get(fleet.a, cid).state == pb.CONTEXT_STATE_READY  # nothing read it yet: nobody knows
        repaired = c.admin.Verify(apb.VerifyRequest(context_id=cid, repair=True), metadata=c.metadata,
                                  timeout=30).results[0]
    finally:
        c.close()
    assert not repaired.ok and repaired.marked_damaged
    assert get(fleet.a, cid).state == pb.CONTEXT_STATE_DAMAGED
    assert put(fleet.b, text).context.state == pb.CONTEXT_STATE_READY and len(tokens(fleet.b, cid)) == 8


def test_a_fleet_role_needs_redis_and_an_object_store(capsys):
    assert cli.main(["serve", "--role", "decoder", "--model", "random:tiny"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--role decoder needs --redis" in err


def test_an_indexer_with_an_http_port_is_refused(tmp_path):
    from ctxcache.service.config import (FleetSettings, RegistrySettings, ServerConfig, ServiceConfig,
                                         StoreSettings)

    def config(role: str) -> ServiceConfig:  # checked before anything starts (cli: one line)
        return ServiceConfig(server=ServerConfig(http_port=0), registry=RegistrySettings("redis://127.0.0.1:1/0"),
                             store=StoreSettings(tmp_path, object_store_uri=f"file://{tmp_path}/objects"),
                             fleet=FleetSettings(role))
    assert config("decoder").server.http_port == 0
    with pytest.raises(ValueError, match="--http-port belongs on a decoder"):
        config("indexer")


def test_redis_down_local_tiers_keep_serving_new_builds_unavailable_then_recover(fleet):
    cid = put(fleet.a, TEXT + " before the outage").context.context_id
    expected = tokens(fleet.b, cid)  # hot on b
    fleet.redis.stop()
    try:
        assert tokens(fleet.b, cid) == expected
        t0 = time.monotonic()
        assert code_of(lambda: put(fleet.a, TEXT + " during the outage")) == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - t0 < 2.0
        tenant = failure(lambda: put(fleet.a, TEXT + " during the outage", token="alpha-token"))
        assert tenant.code() == grpc.StatusCode.UNAVAILABLE
        assert_no_address(tenant, "registry unavailable", str(fleet.redis.port))
        admin = failure(lambda: put(fleet.a, TEXT + " during the outage"))
        assert str(fleet.redis.port) in admin.details()  # the operator reads where
        assert str(fleet.redis.port) in fleet.a.log()  # and so does the server log
    finally:
        fleet.redis.start()  # empty: Redis held facts and jobs; the object store keeps the artifacts
    info = put(fleet.a, TEXT + " after the outage").context
    assert info.state == pb.CONTEXT_STATE_READY
    c = fleet.a.client()  # an operator's reconcile still answers (the indexers may have run theirs first)
    assert not c.admin.Reconcile(apb.ReconcileRequest(), metadata=c.metadata).damaged
    c.close()
    registry = fleet.registry()
    assert wait_until(lambda: registry.facts(cid).state == FleetState.READY, 15)
    registry.close()


def test_redis_restarted_empty_gets_the_stored_contexts_back_without_a_restart_or_reconcile(fleet):
    cid = put(fleet.a, TEXT + " stored before Redis lost its data").context.context_id
    registry = fleet.registry()
    assert registry.facts(cid).state == FleetState.READY
    fleet.redis.stop()
    fleet.redis.start()  # empty: persistence is off
    try:
        assert registry.facts(cid) is None
        # the indexers notice within a few of their heartbeats (0.3 s here) and reconcile
        back = wait_until(lambda: (f := registry.facts(cid)) is not None and f.state == FleetState.READY, 15)
    finally:
        registry.close()
    assert back, "the registry did not get its entry back"
    assert any("came back empty" in ix.log() for ix in fleet.indexers)


def test_object_store_stopped_local_tiers_serve_cold_loads_unavailable_then_recover(fleet):
    warm = put(fleet.a, TEXT + " warm before the outage").context.context_id
    cold = put(fleet.a, TEXT + " cold before the outage").context.context_id
    tenants = put(fleet.a, TEXT + " a tenant's, cold", token="alpha-token").context.context_id
    expected = tokens(fleet.b, warm)  # in b's DRAM and its local store
    c = fleet.b.client()
    fleet.s3.stop()
    try:
        assert tokens(fleet.b, warm) == expected  # DRAM
        c.admin.Evict(apb.EvictRequest(context_id=warm, memory_only=True), metadata=c.metadata)
        assert tokens(fleet.b, warm) == expected  # b's local store
        t0, seen = time.monotonic(), []
        assert code_of(lambda: tokens(fleet.b, cold, timeout=10, seen=seen)) == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - t0 < 10 and seen == []  # within the call's deadline, before any token
        err = failure(lambda: tokens(fleet.b, tenants, token="alpha-token", timeout=10))
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        assert_no_address(err, "object store unavailable", fleet.s3.endpoint, "s3://")
    finally:
        c.close()
        fleet.s3.start()  # the same data: what it acknowledged before the stop is there
    assert len(tokens(fleet.b, cold)) == 8
    assert put(fleet.a, TEXT + " after the outage").context.state == pb.CONTEXT_STATE_READY


def test_a_hung_object_store_fails_cold_loads_in_seconds_and_the_next_at_once(fleet):
    cold = [put(fleet.a, TEXT + f" cold {i} before the freeze").context.context_id for i in range(2)]
    fleet.s3.pause()  # SIGSTOP: the port open, nothing answering
    try:
        took = []
        for cid in cold:
            t0 = time.monotonic()
            err = failure(lambda: tokens(fleet.b, cid, timeout=30))
            took.append(time.monotonic() - t0)
            assert err.code() == grpc.StatusCode.UNAVAILABLE, err.details()
    finally:
        fleet.s3.resume()
    assert took[0] < 6 and took[1] < 1, took  # the SDK alone took 20 s for each
    time.sleep(3)  # past the breaker's open_s: a probe finds the store back
    assert len(tokens(fleet.b, cold[0])) == 8
