"""Two services, each with its own LMDB, on one object store (a folder, or a real SeaweedFS):
a context built on one generates on the other without a rebuild, with the same tokens."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from ctxcache.client.gen.v1 import context_pb2 as pb
from ctxcache.store.object import object_layout as lay

from service_helpers import TEXT, ask, put_text, rpc_code, tiny_config


def shared_config(data: Path, uri: str):  # noqa: ANN201 (ServiceConfig)
    cfg = tiny_config(data)
    return replace(cfg, store=replace(cfg.store, object_store_uri=uri))


@pytest.fixture(params=["file", pytest.param("s3", marks=pytest.mark.s3)])
def object_uri(request, tmp_path: Path) -> str:
    if request.param == "file":
        return f"file://{tmp_path / 'shared'}"
    return request.getfixturevalue("s3_server").uri()


def test_a_context_built_on_one_worker_generates_on_another(start, tmp_path: Path, object_uri: str) -> None:
    a, ca = start(shared_config(tmp_path / "a", object_uri))
    b, cb = start(shared_config(tmp_path / "b", object_uri))
    cid = put_text(ca).context_id
    tokens_a = [t for e in ask(ca, cid)[0][:-1] for t in e.chunk.token_ids]
    events, final = ask(cb, cid)  # b never saw the context: loaded from the object store
    assert [t for e in events[:-1] for t in e.chunk.token_ids] == tokens_a and tokens_a
    assert final.usage.cached_tokens > 0
    assert put_text(cb).context_id == cid  # no rebuild: the object store has it
    assert b.metrics.registry.get_sample_value("ctxcache_put_requests_total", {"result": "existing"}) == 1
    loads = b.backend.store.load_stats()
    assert loads.tiers["object"].hits == 1 and loads.tiers["object"].bytes > 0
    # the download was handed over as it landed: the reported load time still covers all of it
    assert final.timings.load_seconds >= loads.tiers["object"].seconds > 0


@pytest.mark.parametrize("how,layer", [("flip", 0), ("truncate", 0), ("flip", -1), ("truncate", -1)])
def test_a_damaged_object_is_data_loss_before_any_token(start, tmp_path: Path, how: str, layer: int) -> None:
    """layer -1: the last layer's chunk, found while the earlier layers have landed already
    (an object store download is handed over as it lands: ctxcache/landing.py)."""
    uri = f"file://{tmp_path / 'shared'}"
    a, ca = start(shared_config(tmp_path / "a", uri))
    b, cb = start(shared_config(tmp_path / "b", uri))
    cid = put_text(ca).context_id
    shared = a.backend.store.shared
    key = [k for k in lay.chunk_keys(shared.manifest(cid)) if k.endswith(".k")][layer]
    data = shared.tier.get(key)
    shared.tier.put(key, data[:-3] if how == "truncate" else data[:9] + bytes([data[9] ^ 4]) + data[10:])
    events = []
    with pytest.raises(grpc.RpcError) as err:
        for e in cb.generate(pb.GenerateRequest(context_id=cid, question="Where?",
                                                sampling=pb.SamplingParams(max_tokens=4)), timeout=60):
            events.append(e)
    assert err.value.code() == grpc.StatusCode.DATA_LOSS and "chunk" in err.value.details()
    assert events == []
    assert b.backend.store.local.manifest(cid) is None and cid not in b.decoder.cache  # nothing of it kept


def test_a_bad_object_store_uri_is_refused_at_configuration(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="scheme 'gs' is not supported"):
        shared_config(tmp_path, "gs://bucket/prefix")


@pytest.mark.s3
def test_object_store_down_generate_from_local_copies_cold_contexts_unavailable(start, tmp_path: Path, s3_server) -> None:
    a, ca = start(shared_config(tmp_path / "a", s3_server.uri()))
    cid = put_text(ca).context_id
    other = put_text(ca, TEXT + " another").context_id
    a.decoder.cache.evict(cid)  # DRAM forgets both: the next Generate reads the local LMDB
    a.decoder.cache.evict(other)
    a.backend.store.local.delete(other)  # and this one only the object store has
    s3_server.stop()
    assert ask(ca, cid)[1].usage.generated_tokens >= 1
    assert rpc_code(lambda: ask(ca, other, timeout=60)) == grpc.StatusCode.UNAVAILABLE
    s3_server.start()
    assert ask(ca, other)[1].usage.cached_tokens > 0
    assert put_text(ca, TEXT + " after").state == pb.CONTEXT_STATE_READY


def test_evict_local_only_keeps_the_object_store_copy_and_the_next_generate_loads_it(start, tmp_path: Path) -> None:
    from ctxcache.client.gen.v1 import admin_pb2 as apb

    a, ca = start(shared_config(tmp_path / "a", f"file://{tmp_path / 'shared'}"))
    cid = put_text(ca).context_id
    tokens = [t for e in ask(ca, cid)[0][:-1] for t in e.chunk.token_ids]
    assert ca.admin.Evict(apb.EvictRequest(context_id=cid, local_only=True)).evicted
    store = a.backend.store
    assert store.local.manifest(cid) is None and store.shared.manifest(cid) is not None
    before = store.load_stats().tiers["object"].hits
    events, final = ask(ca, cid)
    assert [t for e in events[:-1] for t in e.chunk.token_ids] == tokens and final.usage.cached_tokens > 0
    assert store.load_stats().tiers["object"].hits == before + 1  # from the object store, not a rebuild
    with pytest.raises(grpc.RpcError) as err:
        ca.admin.Evict(apb.EvictRequest(context_id=cid, local_only=True, memory_only=True))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.s3
def test_a_request_deadline_bounds_cold_calls_on_a_hung_object_store(start, tmp_path: Path, s3_server) -> None:
    """Issue 43: object-store calls carry the request's deadline. With 1 s on a SIGSTOPped store
    the server answers before it, DEADLINE_EXCEEDED naming the object store (not the client's
    bare timeout after a 3 s call), and the breaker stays closed: the store, back, answers."""
    a, ca = start(shared_config(tmp_path / "a", s3_server.uri()))
    cid = put_text(ca).context_id
    a.decoder.cache.evict(cid)
    a.backend.store.local.delete(cid)  # only the object store has it: every read is a cold one
    s3_server.pause()
    try:
        errors, took = [], []
        for call in (lambda: ask(ca, cid, timeout=1.0),
                     lambda: ca.context.GetContext(pb.GetContextRequest(context_id=cid), timeout=1.0)):
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                call()
            took.append(time.monotonic() - t0)
            errors.append((err.value.code(), err.value.details()))
    finally:
        s3_server.resume()
    for code, details in errors:
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "object store" in details, errors
    assert max(took) < 1.2, took
    assert ask(ca, cid)[1].usage.cached_tokens > 0
