"""Against a real redis-server: Redis stopped mid-run, then back."""

from __future__ import annotations

import time

import grpc
import pytest

from ctxcache.client.gen.v1 import admin_pb2 as apb, context_pb2 as pb
from ctxcache.store import BuildState, RedisRegistry

from service_helpers import TEXT, ask, put_text, rpc_code, tiny_config

pytestmark = pytest.mark.redis


def test_redis_down_generate_keeps_working_put_fails_fast_then_recovers(start, redis_server, tmp_path):
    cfg = tiny_config(tmp_path / "data", redis_url=redis_server.url)
    srv, client = start(cfg)
    cid = put_text(client).context_id
    registry = RedisRegistry(cfg.registry.redis_config())
    assert registry.get(cid).state == BuildState.READY
    ask(client, cid)  # loaded into DRAM

    redis_server.stop()
    assert ask(client, cid, max_tokens=4)[1].usage.generated_tokens >= 1
    t0 = time.monotonic()
    code = rpc_code(lambda: put_text(client, TEXT + " a new context"))
    assert code == grpc.StatusCode.UNAVAILABLE and time.monotonic() - t0 < 2.0
    stats = client.admin.Stats(apb.StatsRequest())
    assert stats.registry == "redis" and not stats.registry_available
    assert rpc_code(lambda: client.admin.Reconcile(apb.ReconcileRequest())) == grpc.StatusCode.UNAVAILABLE

    redis_server.start()  # empty: Redis held only an index; Reconcile rebuilds it from LMDB
    assert client.admin.Reconcile(apb.ReconcileRequest()).registered == 1
    assert registry.get(cid).state == BuildState.READY
    info = put_text(client, TEXT + " a new context")
    assert info.state == pb.CONTEXT_STATE_READY and registry.get(info.context_id).state == BuildState.READY
    assert ask(client, info.context_id)[1].usage.cached_tokens == info.n_tokens
    registry.close()


def test_two_services_share_one_redis(start, redis_server, tmp_path):
    """Two workers (own stores) on one Redis: each sees its own contexts registered by location."""
    a, ca = start(tiny_config(tmp_path / "a", redis_url=redis_server.url))
    b, cb = start(tiny_config(tmp_path / "b", redis_url=redis_server.url))
    ida = put_text(ca, TEXT + " for a").context_id
    idb = put_text(cb, TEXT + " for b").context_id
    registry = RedisRegistry(tiny_config(tmp_path, redis_url=redis_server.url).registry.redis_config())
    assert registry.get(ida).location == a.backend.store.location
    assert registry.get(idb).location == b.backend.store.location
    assert cb.admin.Reconcile(apb.ReconcileRequest()).removed == 0  # b leaves a's entries alone
    assert registry.get(ida) is not None
    registry.close()


def test_a_context_ready_on_one_worker_is_never_a_permanent_unavailable_on_the_other(start, redis_server, tmp_path):
    """Issue 22 #4: the registry records a reachable host:port; worker b, lacking a context READY
    on a, names where it lives for Generate and builds its own copy on PutContext."""
    a, ca = start(tiny_config(tmp_path / "a", redis_url=redis_server.url))
    b, cb = start(tiny_config(tmp_path / "b", redis_url=redis_server.url))
    cid = put_text(ca).context_id
    registry = RedisRegistry(tiny_config(tmp_path, redis_url=redis_server.url).registry.redis_config())
    assert registry.get(cid).location == f"127.0.0.1:{a.port}"  # an address, not a path
    with pytest.raises(grpc.RpcError) as err:
        ask(cb, cid)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and f"127.0.0.1:{a.port}" in err.value.details()
    info = put_text(cb)  # same text: same id; b builds its own copy instead of UNAVAILABLE forever
    assert info.context_id == cid and info.state == pb.CONTEXT_STATE_READY
    assert ask(cb, cid)[1].usage.cached_tokens == info.n_tokens
    registry.close()
