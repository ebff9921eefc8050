"""Issue 22 #1: no single PutContext can wedge the build queue.

Method parameters are bounded (INVALID_ARGUMENT naming the field, before anything is queued)
and a running build is cancelled by DeleteContext / Evict within a couple of seconds."""

from __future__ import annotations

import math
import time
from pathlib import Path

import grpc
import pytest
from google.protobuf import struct_pb2

from ctxcache.service.config import GiB, IndexerSettings, ModelConfig, ServerConfig, ServiceConfig, StoreSettings
from ctxcache.service.demo_text import TEXT
from ctxcache.client.gen.v1 import admin_pb2 as apb, context_pb2 as pb

from service_helpers import put_text, rpc_code

BAD = [  # (params, field named in the error)
    ({"kmeans_iters": 1e9}, "method.params.kmeans_iters"),
    ({"centroids": 2.5}, "method.params.centroids"),
    ({"seed": 1e30}, "method.params.seed"),
    ({"max_queries": 0}, "method.params.max_queries"),
    ({"subspaces": 7}, "method.params.subspaces"),  # does not divide head_dim
    ({"subspaces": 1e6}, "method.params.subspaces"),
    ({"list_fraction": math.nan}, "method.params.list_fraction"),
    ({"backoff_cos": math.inf}, "method.params.backoff_cos"),
    ({"backoff_cos": -math.inf}, "method.params.backoff_cos"),
    ({"centroids": 4096, "max_queries": 1 << 20}, "method.params"),
]


def _put(params: dict, wait: bool = False) -> pb.PutContextRequest:
    s = struct_pb2.Struct()
    s.update(params)
    return pb.PutContextRequest(text="some context", wait=wait,
                                method=pb.MethodSpec(name="csattention", params=s))


@pytest.mark.parametrize("params,field", BAD, ids=[str(p) for p, _ in BAD])
def test_out_of_bounds_params_are_invalid_argument(start, params, field):
    srv, client = start()
    with pytest.raises(grpc.RpcError) as err:
        client.put(_put(params), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert err.value.details().startswith(field), err.value.details()
    assert srv.indexer.counts() == (0, 0) and srv.indexer.queued() == 0  # nothing queued


def test_a_running_4k_build_is_cancelled_by_delete_within_2s(smollm2, tmp_path, start):
    cfg = ServiceConfig(server=ServerConfig(port=0, grace_seconds=1.0), model=ModelConfig("smollm2"),
                        store=StoreSettings(Path(tmp_path / "d"), 2 * GiB),
                        indexer=IndexerSettings(method="key-kmeans"))
    srv, client = start(cfg)
    text = (TEXT + "\n") * 10  # ~4K tokens: a ~20 s prefill on 2 CPU cores
    info = client.put(pb.PutContextRequest(text=text, wait=False), timeout=30).context
    assert info.state == pb.CONTEXT_STATE_BUILDING and 3800 <= info.n_tokens <= 4096
    time.sleep(1.0)  # inside the prefill
    t0 = time.perf_counter()
    assert client.context.DeleteContext(pb.DeleteContextRequest(context_id=info.context_id), timeout=10).deleted
    job = srv.indexer.job(info.context_id)
    assert job is None  # the cancelled job is gone: the id is free to build again
    stats = client.admin.Stats(apb.StatsRequest(), timeout=5)
    took = time.perf_counter() - t0
    print(f"cancel latency {took:.2f}s")
    assert stats.contexts_building == 0 and took < 2.0, took
    assert rpc_code(lambda: client.context.GetContext(
        pb.GetContextRequest(context_id=info.context_id), timeout=5)) == grpc.StatusCode.NOT_FOUND
    assert srv.metrics.builds.labels("cancelled")._value.get() == 1
    # the queue is free: a short context builds behind it at once
    assert put_text(client, TEXT[:400]).state == pb.CONTEXT_STATE_READY


def test_a_build_past_its_time_bound_fails_and_frees_the_queue(tiny_lm, tmp_path, start):
    from service_helpers import tiny_config
    from dataclasses import replace
    cfg = tiny_config(tmp_path / "d")
    cfg = replace(cfg, indexer=replace(cfg.indexer, build_timeout_s=1e-3))
    srv, client = start(cfg)
    info = put_text(client)
    assert info.state == pb.CONTEXT_STATE_FAILED and "time bound" in info.error, info.error


def test_progress_moves_through_the_build(start):
    from test_drain import slow_put
    srv, client = start()
    info = client.put(slow_put("abc " * 150, False), timeout=10).context
    seen = set()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not any(0.1 < p < 1.0 for p in seen):
        seen.add(round(client.context.GetContext(pb.GetContextRequest(context_id=info.context_id), timeout=5).progress, 2))
        time.sleep(0.05)
    # past queued (0.1) while the slow index build runs: the blocks prefilled counted (a layer-major
    # build indexes a layer as soon as its prefill ends, so its progress need not reach 0.7 first)
    assert any(0.1 < p < 1.0 for p in seen), sorted(seen)


def test_evict_cancels_a_running_build(start):
    from test_drain import slow_put
    srv, client = start()
    info = client.put(slow_put("abc " * 150, False), timeout=10).context
    time.sleep(0.5)
    t0 = time.perf_counter()
    assert client.admin.Evict(apb.EvictRequest(context_id=info.context_id), timeout=10).evicted
    assert srv.indexer.counts() == (0, 0) and time.perf_counter() - t0 < 2.0
