"""Issue 22 #5: tenants bound to credentials. Two tokens, two tenants, one admin token:
0 cross-tenant list, read, generate or delete; admin needs the admin credential."""

from __future__ import annotations

from dataclasses import replace

import grpc
import pytest

from ctxcache.client import Client
from ctxcache.client.gen.v1 import admin_pb2 as apb, context_pb2 as pb

from service_helpers import TEXT, ask, put_text, rpc_code, tiny_config

TOKENS = (("tok-a", "acme"), ("tok-b", "bolt"))


@pytest.fixture
def tenants(start, tmp_path):
    cfg = tiny_config(tmp_path / "d", auth_token="admin-secret")
    cfg = replace(cfg, server=replace(cfg.server, tenant_tokens=TOKENS))
    srv, admin = start(cfg)
    a = Client(f"127.0.0.1:{srv.port}", "tok-a")
    b = Client(f"127.0.0.1:{srv.port}", "tok-b")
    yield srv, admin, a, b
    a.close()
    b.close()


def test_tenant_matrix(tenants):
    srv, admin, a, b = tenants
    ids = {"acme": put_text(a, TEXT).context_id, "bolt": put_text(b, TEXT).context_id}
    assert ids["acme"] != ids["bolt"]  # the tenant is part of the identity
    cross = 0
    for me, them, other in ((a, "bolt", b), (b, "acme", a)):
        cid = ids[them]
        listed = [c.context_id for c in me.context.ListContexts(pb.ListContextsRequest(), metadata=me.metadata).contexts]
        cross += cid in listed
        cross += rpc_code(lambda: me.context.GetContext(pb.GetContextRequest(context_id=cid),
                                                        metadata=me.metadata)) != grpc.StatusCode.NOT_FOUND
        cross += rpc_code(lambda: ask(me, cid)) != grpc.StatusCode.NOT_FOUND
        cross += me.context.DeleteContext(pb.DeleteContextRequest(context_id=cid), metadata=me.metadata).deleted
        cross += rpc_code(lambda: me.admin.Evict(apb.EvictRequest(context_id=cid), metadata=me.metadata)) \
            != grpc.StatusCode.PERMISSION_DENIED
    assert cross == 0
    # each tenant still sees and uses its own; the admin sees both
    for me, mine in ((a, "acme"), (b, "bolt")):
        listed = [c.context_id for c in me.context.ListContexts(pb.ListContextsRequest(), metadata=me.metadata).contexts]
        assert listed == [ids[mine]]
        assert ask(me, ids[mine])[1].usage.cached_tokens > 0
    every = admin.context.ListContexts(pb.ListContextsRequest(), metadata=admin.metadata).contexts
    assert {c.context_id for c in every} == set(ids.values())


def test_a_tenant_cannot_claim_another_tenant_in_put(tenants):
    _, _, a, _ = tenants
    assert rpc_code(lambda: a.put(pb.PutContextRequest(text="x", tenant="bolt"), timeout=10)) \
        == grpc.StatusCode.PERMISSION_DENIED


def test_auth_comes_before_method_lookup_and_admin_needs_the_admin_token(tenants):
    srv, admin, a, _ = tenants
    channel = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
    nobody = channel.unary_unary("/ctxcache.v1.NoSuchService/Nope")
    assert rpc_code(lambda: nobody(b"", timeout=5)) == grpc.StatusCode.UNAUTHENTICATED
    assert rpc_code(lambda: a.admin.Stats(apb.StatsRequest(), metadata=a.metadata, timeout=5)) \
        == grpc.StatusCode.PERMISSION_DENIED
    assert admin.admin.Stats(apb.StatsRequest(), metadata=admin.metadata, timeout=5).model_id
    channel.close()
