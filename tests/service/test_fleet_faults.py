"""Issue 33's fleet (fleet_procs.py) when a part fails: objects damaged in the object store
(DATA_LOSS, DAMAGED, rebuilt by a Put), roles refused without their parts, and Redis or the
object store stopped, hung and back (the local tiers serve on). Tests that stop a shared part
(Redis, the object store) come last."""

from __future__ import annotations

import time

import grpc
import pytest
import redis

from ctxcache.client.gen.v1 import admin_pb2 as apb, context_pb2 as pb
from ctxcache.service.cli import main as cli
from ctxcache.store.registries.fleet_registry import FleetState

from fleet_procs import (TEXT, Worker, assert_no_address, failure, fleet, get,  # noqa: F401 (fixture)
                         put, tokens, wait_until)
from s3_server import S3Server
from service_helpers import rpc_code

pytestmark = [pytest.mark.redis, pytest.mark.s3, pytest.mark.timeout(300)]


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
    assert rpc_code(lambda: get(fleet.b, made["id"])) == grpc.StatusCode.NOT_FOUND  # deleted fleet-wide


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
    assert rpc_code(lambda: get(fleet.b, cid, token="beta-token")) == grpc.StatusCode.NOT_FOUND
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
    assert rpc_code(lambda: get(fleet.a, cid)) == grpc.StatusCode.NOT_FOUND
    assert put(fleet.a, TEXT + f" damaged, then {how}d").created  # built anew


def test_a_damaged_chunk_is_damaged_after_a_failed_load_and_a_put_rebuilds_it(fleet):
    text = TEXT + " whose chunk is damaged"
    cid = put(fleet.a, text).context.context_id
    expected = tokens(fleet.one, put(fleet.one, text).context.context_id)
    damage(fleet.s3, cid, "corrupt")
    assert rpc_code(lambda: tokens(fleet.b, cid)) == grpc.StatusCode.DATA_LOSS  # b has no copy: a cold load
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
        assert rpc_code(lambda: put(fleet.a, TEXT + " during the outage")) == grpc.StatusCode.UNAVAILABLE
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
    registry, raw = fleet.registry(), redis.Redis.from_url(fleet.redis.url, decode_responses=True)
    assert registry.facts(cid).state == FleetState.READY
    raw.set("test:sentinel", "1")  # nothing of ctxcache writes it: it shows whether Redis came back empty
    fleet.redis.stop()
    fleet.redis.start()  # empty: persistence is off
    try:
        # (not the entry itself: the indexers may have put it back before a first look, 2 busy cores)
        assert raw.get("test:sentinel") is None
        # the indexers notice within a few of their heartbeats (0.3 s here) and reconcile
        back = wait_until(lambda: (f := registry.facts(cid)) is not None and f.state == FleetState.READY, 15)
    finally:
        registry.close()
        raw.close()
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
        assert rpc_code(lambda: tokens(fleet.b, cold, timeout=10, seen=seen)) == grpc.StatusCode.UNAVAILABLE
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
