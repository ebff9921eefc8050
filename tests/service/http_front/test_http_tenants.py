"""Issue 34: the HTTP front takes the gRPC front's bearer tokens with the same isolation: a
tenant sees, uses, updates and deletes only its own cached contents (a matrix, 0 crossings),
finds only its own automatically, and the admin token sees all and reads /metrics."""

from __future__ import annotations

from dataclasses import replace

import httpx
import pytest

from ctxcache.client import Client
from ctxcache.client.gen.v1 import context_pb2 as pb

from http_helpers import assert_error_shape, in_process, tiny_http_config
from service_helpers import TEXT

TOKENS = (("tok-a", "acme"), ("tok-b", "bolt"))
QUESTION = [{"role": "user", "content": "Where is the lighthouse?"}]


@pytest.fixture(scope="module")
def server(tiny_lm, tmp_path_factory):
    cfg = tiny_http_config(tmp_path_factory.mktemp("tenants") / "d", auth_token="admin-secret")
    cfg = replace(cfg, server=replace(cfg.server, tenant_tokens=TOKENS))
    with in_process(tiny_lm, cfg) as running:
        yield running


def client(base: str, token: str | None) -> httpx.Client:
    return httpx.Client(base_url=base, timeout=60, headers={"Authorization": f"Bearer {token}"} if token else {})


def test_tenant_matrix_through_http(server):
    srv, base = server
    a, b, admin = client(base, "tok-a"), client(base, "tok-b"), client(base, "admin-secret")
    ids = {name: c.post("/v1/cached_contents", json={"text": TEXT, "wait": True}).json()["id"]
           for name, c in (("acme", a), ("bolt", b))}
    assert ids["acme"] != ids["bolt"]  # the tenant is part of the identity
    only_bolt = b.post("/v1/cached_contents", json={"text": TEXT + " Bolt only.", "wait": True}).json()["id"]
    cross = 0
    for me, them, mine in ((a, "bolt", "acme"), (b, "acme", "bolt")):
        cid = ids[them]
        listed = [c["id"] for c in me.get("/v1/cached_contents").json()["cached_contents"]]
        cross += cid in listed
        cross += me.get(f"/v1/cached_contents/{cid}").status_code != 404
        cross += me.patch(f"/v1/cached_contents/{cid}", json={"ttl": "5s"}).status_code != 404
        ask = {"cached_content": cid, "messages": QUESTION, "max_tokens": 2}
        cross += me.post("/v1/chat/completions", json=ask).status_code != 404
        cross += me.post("/v1/chat/completions", json={**ask, "stream": True}).status_code != 404
        text = {"cached_content": cid, "prompt": "x", "max_tokens": 2}
        cross += me.post("/v1/completions", json=text).status_code != 404
        cross += me.delete(f"/v1/cached_contents/{cid}").status_code != 404
        # automatically: the same leading messages find the caller's own context, never the other's
        auto = me.post("/v1/chat/completions", json={"messages": [{"role": "system", "content": TEXT}, *QUESTION],
                                                     "max_tokens": 2}).json()
        cross += auto["cached_content"] != ids[mine]
    auto = a.post("/v1/chat/completions", json={"messages": [{"role": "system", "content": TEXT + " Bolt only."},
                                                             *QUESTION], "max_tokens": 2})
    cross += auto.json()["cached_content"] is not None  # a miss: bolt's context is not acme's
    assert cross == 0
    for me, mine in ((a, "acme"), (b, "bolt")):  # each still has its own, as gRPC says
        listed = {c["id"] for c in me.get("/v1/cached_contents").json()["cached_contents"]}
        grpc_client = Client(f"127.0.0.1:{srv.port}", me.headers["Authorization"].split()[1])
        via_grpc = {c.context_id for c in grpc_client.context.ListContexts(
            pb.ListContextsRequest(), metadata=grpc_client.metadata).contexts}
        grpc_client.close()
        assert listed == via_grpc and ids[mine] in listed and (only_bolt in listed) == (mine == "bolt")
    every = {c["id"] for c in admin.get("/v1/cached_contents").json()["cached_contents"]}
    assert every == {*ids.values(), only_bolt}
    assert admin.get(f"/v1/cached_contents/{ids['acme']}").json()["state"] == "READY"


def test_tokens_before_anything_and_admin_for_metrics(server):
    _, base = server
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "tok-a"}):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("GET", "/no/such/path")):
            r = httpx.request(method, base + path, headers=headers, content=b"{not json", timeout=30)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", (method, path, r.text)
            assert assert_error_shape(r)["code"] == "unauthenticated"
    assert httpx.get(f"{base}/health", timeout=30).json() == {"status": "ok"}  # load balancers need no token
    a, admin = client(base, "tok-a"), client(base, "admin-secret")
    r = a.get("/metrics")
    assert r.status_code == 403 and assert_error_shape(r)["type"] == "permission_error"
    r = a.post("/v1/cached_contents", json={"text": "x", "tenant": "bolt"})
    assert r.status_code == 403 and assert_error_shape(r)["code"] == "permission_denied"
    text = admin.get("/metrics").text
    assert 'ctxcache_http_requests_total{method="GET",route="/metrics",status="403"} 1.0' in text
    assert 'route="unmatched",status="401"' in text and "ctxcache_http_request_seconds_bucket" in text
