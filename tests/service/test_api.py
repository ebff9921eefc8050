"""The full PutContext -> Generate path and the service behaviours the issue asks for."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from concurrent.futures import ThreadPoolExecutor

import grpc
import lmdb
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ctxcache.client.gen.v1 import admin_pb2 as apb, context_pb2 as pb
from ctxcache.store import ChunkKey

from service_helpers import TEXT, ask, put_text, rpc_code, tiny_config


def test_put_then_generate_streams_text_usage_and_timings(start):
    srv, client = start()
    info = put_text(client, labels={"team": "docs"})
    assert info.state == pb.CONTEXT_STATE_READY and len(info.context_id) == 64
    assert info.n_tokens > 100 and dict(info.labels) == {"team": "docs"} and info.artifact_bytes > 0
    events, final = ask(client, info.context_id, max_tokens=6)
    chunks = [e.chunk for e in events[:-1]]
    assert final.usage.cached_tokens == info.n_tokens and final.usage.new_prompt_tokens > 0
    assert final.usage.generated_tokens == sum(len(c.token_ids) for c in chunks) <= 6
    assert final.text == "".join(c.text for c in chunks)
    assert final.timings.ttft_seconds > 0 and not final.timings.cache_hit
    assert ask(client, info.context_id)[1].timings.cache_hit  # second ask: DRAM hit
    assert client.context.GetContext(pb.GetContextRequest(context_id=info.context_id)).state == pb.CONTEXT_STATE_READY


def test_sixteen_identical_puts_build_once(start):
    srv, client = start()
    with ThreadPoolExecutor(16) as pool:
        infos = list(pool.map(lambda _: client.put(pb.PutContextRequest(text=TEXT + "16", wait=True), timeout=60),
                              range(16)))
    assert len({r.context.context_id for r in infos}) == 1
    assert sum(r.created for r in infos) == 1
    assert all(r.context.state == pb.CONTEXT_STATE_READY for r in infos)
    assert srv.metrics.builds.labels("ready")._value.get() == 1


def test_same_context_other_tenant_or_method_gets_another_id(start):
    _, client = start()
    a = put_text(client).context_id
    assert put_text(client).context_id == a
    assert put_text(client, tenant="acme").context_id != a
    assert put_text(client, method=pb.MethodSpec(name="oracle")).context_id != a


def test_restart_keeps_every_ready_context(start, tmp_path):
    cfg = tiny_config(tmp_path / "keep")
    srv, client = start(cfg)
    ids = {put_text(client, TEXT + str(i)).context_id for i in range(3)}
    srv.stop(1)
    srv2, client2 = start(cfg)
    listed = {c.context_id for c in client2.context.ListContexts(pb.ListContextsRequest()).contexts}
    assert listed == ids
    for cid in ids:
        assert ask(client2, cid)[1].usage.cached_tokens > 0


def test_list_pages(start):
    _, client = start()
    ids = {put_text(client, TEXT + str(i)).context_id for i in range(5)}
    seen, token = [], ""
    while True:
        page = client.context.ListContexts(pb.ListContextsRequest(page_size=2, page_token=token))
        assert len(page.contexts) <= 2
        seen += [c.context_id for c in page.contexts]
        token = page.next_page_token
        if not token:
            break
    assert sorted(seen) == sorted(ids)


def test_flipped_byte_verify_reports_and_generate_is_data_loss(start, tmp_path):
    cfg = tiny_config(tmp_path / "flip")
    srv, client = start(cfg)
    cid = put_text(client).context_id
    srv.stop(1)
    env = lmdb.open(str(cfg.store.path), subdir=True)
    key = ChunkKey(cid, 1, "k").to_string().encode()
    with env.begin(write=True) as txn:
        data = bytearray(txn.get(key))
        data[len(data) // 2] ^= 0x01
        txn.put(key, bytes(data))
    env.close()
    srv, client = start(cfg)
    result = client.admin.Verify(apb.VerifyRequest(context_id=cid)).results[0]
    assert not result.ok and any("1:k" in p for p in result.problems)
    stream = client.generate(pb.GenerateRequest(context_id=cid, question="q?"))
    got = []
    with pytest.raises(grpc.RpcError) as err:
        for ev in stream:
            got.append(ev)
    assert err.value.code() == grpc.StatusCode.DATA_LOSS and got == []


def test_evict_during_fifty_streams_each_complete_or_not_found_first(start):
    srv, client = start(max_streams=60, threads=80)
    cid = put_text(client).context_id
    outcomes, lock = [], threading.Lock()

    def one(i: int, after_evict: bool) -> None:
        tokens, outcome = 0, None
        try:
            for ev in client.generate(pb.GenerateRequest(context_id=cid, question=f"q{i}?",
                                                         sampling=pb.SamplingParams(max_tokens=12)), timeout=60):
                if ev.HasField("chunk"):
                    tokens += len(ev.chunk.token_ids)
                else:
                    outcome = ("complete", tokens == ev.final.usage.generated_tokens)
        except grpc.RpcError as err:
            outcome = (err.code().name, tokens)
        with lock:
            outcomes.append((after_evict, outcome))

    before = [threading.Thread(target=one, args=(i, False)) for i in range(25)]
    for t in before:
        t.start()
    time.sleep(0.05)
    client.admin.Evict(apb.EvictRequest(context_id=cid))  # from DRAM and the store
    after = [threading.Thread(target=one, args=(i, True)) for i in range(25)]
    for t in after:
        t.start()
    for t in before + after:
        t.join(120)
    assert len(outcomes) == 50
    assert all(o in (("complete", True), ("NOT_FOUND", 0)) for _, o in outcomes), outcomes
    assert all(o == ("NOT_FOUND", 0) for late, o in outcomes if late), "a stream started after Evict was served"
    assert ("complete", True) in [o for late, o in outcomes if not late]


def test_deadline_of_50ms_is_honoured(start):
    srv, client = start()
    cid = put_text(client).context_id
    ask(client, cid)  # warm the DRAM cache: the deadline must stop decoding, not a cold load
    t0 = time.monotonic()
    code = rpc_code(lambda: ask(client, cid, max_tokens=4000, timeout=0.05))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - t0 < 1.0
    deadline = time.monotonic() + 2
    while srv.decoder.active and time.monotonic() < deadline:
        time.sleep(0.01)
    assert srv.decoder.active == 0, "the server kept decoding after the deadline"


def test_streams_beyond_the_bound_are_resource_exhausted(start):
    srv, client = start(max_streams=1, threads=8)
    cid = put_text(client).context_id
    first = client.generate(pb.GenerateRequest(context_id=cid, question="q?",
                                               sampling=pb.SamplingParams(max_tokens=4000)))
    next(first)  # the first stream holds the only slot
    assert rpc_code(lambda: ask(client, cid)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    first.cancel()


def test_bearer_token_and_health_not_serving_on_shutdown(start):
    srv, client = start(auth_token="s3cret")
    assert put_text(client).state == pb.CONTEXT_STATE_READY
    client.metadata = (("authorization", "Bearer wrong"),)
    assert rpc_code(lambda: put_text(client)) == grpc.StatusCode.UNAUTHENTICATED
    health = health_pb2_grpc.HealthStub(client.channel)
    assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
    watch = health.Watch(health_pb2.HealthCheckRequest())
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    threading.Thread(target=srv.stop, args=(1.0,)).start()
    assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING


def test_admin_port_separate_stats_and_rebuild(start):
    srv, client = start(admin_port=0)
    assert srv.admin_port != srv.port
    info = put_text(client, keep_queries=True)
    assert rpc_code(lambda: client.admin.Stats(apb.StatsRequest()))is None
    main_only = type(client)(f"127.0.0.1:{srv.port}")
    assert rpc_code(lambda: main_only.admin.Stats(apb.StatsRequest())) == grpc.StatusCode.UNIMPLEMENTED
    stats = client.admin.Stats(apb.StatsRequest())
    assert stats.contexts_ready == 1 and stats.registry == "embedded" and stats.store_bytes > 0
    (fp,) = stats.footprint  # the server's default codec; the query sample is not counted
    assert fp.kv_codec == info.kv_codec == "int8" and fp.contexts == 1 and fp.tokens == info.n_tokens
    assert fp.stored_bytes < stats.store_bytes and fp.stored_bytes_per_token == fp.stored_bytes / fp.tokens
    assert fp.resident_bytes > info.raw_kv_bytes  # decoded K/V + the rows derived at load
    req = apb.RebuildRequest(context_id=info.context_id, wait=True, method=pb.MethodSpec(name="oracle"))
    rebuilt = client.admin.Rebuild(req)
    assert rebuilt.context.state == pb.CONTEXT_STATE_READY and not rebuilt.reprefilled
    assert rebuilt.context.context_id != info.context_id and rebuilt.context.method == "oracle"
    assert ask(client, rebuilt.context.context_id)[1].usage.cached_tokens == info.n_tokens
    # a query-built method with new parameters: from the stored query sample, no re-prefill
    req.method.name = "csattention"
    req.method.params.update({"subspaces": 4, "centroids": 8})
    cs = client.admin.Rebuild(req)
    assert cs.context.state == pb.CONTEXT_STATE_READY and not cs.reprefilled
    assert cs.context.method == "csattention" and ask(client, cs.context.context_id)[1].usage.generated_tokens > 0
    main_only.close()


def test_kv_codec_is_chosen_per_context_and_part_of_its_identity(start):
    _, client = start()
    lossless = put_text(client, kv_codec="lossless")
    default = put_text(client)
    assert (lossless.kv_codec, default.kv_codec) == ("lossless", "int8") and lossless.context_id != default.context_id
    assert default.artifact_bytes < 0.6 * lossless.artifact_bytes and default.format_version == 2
    assert ask(client, default.context_id)[1].usage.generated_tokens > 0
    assert rpc_code(lambda: put_text(client, kv_codec="fp4")) == grpc.StatusCode.INVALID_ARGUMENT
    # its own method converts without the queries this put did not keep: no re-prefill
    same = client.admin.Rebuild(apb.RebuildRequest(context_id=default.context_id, wait=True))
    assert not same.reprefilled and same.context.context_id == default.context_id


def test_rebuild_without_stored_queries_needs_reprefill(start, tmp_path):
    cfg = tiny_config(tmp_path / "noq")
    _, client = start(replace(cfg, indexer=replace(cfg.indexer, store_queries=0)))
    info = put_text(client)
    req = apb.RebuildRequest(context_id=info.context_id, wait=True,
                             method=pb.MethodSpec(name="csattention", params={"subspaces": 4}))
    assert rpc_code(lambda: client.admin.Rebuild(req)) == grpc.StatusCode.FAILED_PRECONDITION
    req.allow_reprefill = True
    again = client.admin.Rebuild(req)
    assert again.reprefilled and again.context.state == pb.CONTEXT_STATE_READY


def test_build_claim_is_renewed_while_building(start, tmp_path, monkeypatch):
    import ctxcache.indexer.build_queue as indexing

    release = threading.Event()
    real_build = indexing.build_artifact

    def slow_build(*args, **kw):
        release.wait(10)
        return real_build(*args, **kw)

    monkeypatch.setattr(indexing, "build_artifact", slow_build)
    cfg = tiny_config(tmp_path / "lease")
    srv, client = start(replace(cfg, indexer=replace(cfg.indexer, claim_lease_s=0.3)))
    info = client.put(pb.PutContextRequest(text=TEXT, wait=False), timeout=10).context
    assert info.state == pb.CONTEXT_STATE_BUILDING
    time.sleep(1.0)  # > 3 leases: only the heartbeat keeps the claim alive
    assert srv.backend.registry.build_claimed(info.context_id)
    release.set()
    for _ in range(200):
        if client.context.GetContext(pb.GetContextRequest(context_id=info.context_id)).state == \
                pb.CONTEXT_STATE_READY:
            break
        time.sleep(0.05)
    assert not srv.backend.registry.build_claimed(info.context_id)  # released when ready
