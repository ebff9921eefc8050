"""Issue 43 on one node (`--role all`, the embedded registry): damage is a state, as in a fleet.
A chunk or manifest that fails its check answers DATA_LOSS before any token and marks the
context DAMAGED (GetContext and ListContexts show it, to its tenant and the admin only); Delete
and Evict remove it; a Put of the same text builds it again; `admin verify --repair` marks it."""

from __future__ import annotations

from dataclasses import replace

import grpc
import pytest

from ctxcache.client import Client
from ctxcache.client.gen.v1 import admin_pb2 as apb, context_pb2 as pb
from ctxcache.store import ChunkKey
from ctxcache.store.keys import ManifestKey

from service_helpers import TEXT, put_text, rpc_code, tiny_config

TOKENS = (("tok-a", "acme"), ("tok-b", "bolt"))


@pytest.fixture
def node(start, tmp_path):
    """-> (server, admin client, tenant acme's client, tenant bolt's client)."""
    cfg = tiny_config(tmp_path / "d", auth_token="admin-secret")
    srv, admin = start(replace(cfg, server=replace(cfg.server, tenant_tokens=TOKENS)))
    a, b = Client(f"127.0.0.1:{srv.port}", "tok-a"), Client(f"127.0.0.1:{srv.port}", "tok-b")
    yield srv, admin, a, b
    a.close()
    b.close()


def flip(srv, key: bytes, truncate: bool = False) -> None:
    """Flip one byte in the middle of a stored value (or cut it in half), through the server's
    own LMDB handle (one process must not open the file twice)."""
    with srv.backend.store._env.begin(write=True) as txn:
        data = bytearray(txn.get(key))
        if truncate:
            data = data[:len(data) // 2]
        else:
            data[len(data) // 2] ^= 0x01
        txn.put(key, bytes(data))


def chunk_key(cid: str) -> bytes:
    return ChunkKey(cid, 1, "k").to_string().encode()


def greedy(client: Client, cid: str) -> list[int]:
    events = list(client.generate(pb.GenerateRequest(context_id=cid, question="Where is the lighthouse?",
                                                     sampling=pb.SamplingParams(max_tokens=8)), timeout=60))
    return [t for e in events[:-1] for t in e.chunk.token_ids]


def get(client: Client, cid: str) -> pb.ContextInfo:
    return client.context.GetContext(pb.GetContextRequest(context_id=cid), metadata=client.metadata, timeout=10)


def listed(client: Client) -> dict[str, pb.ContextInfo]:
    page = client.context.ListContexts(pb.ListContextsRequest(page_size=100), metadata=client.metadata, timeout=10)
    return {i.context_id: i for i in page.contexts}


def data_loss_before_any_token(client: Client, cid: str) -> None:
    seen = []
    with pytest.raises(grpc.RpcError) as err:
        for event in client.generate(pb.GenerateRequest(context_id=cid, question="Where?"), timeout=60):
            seen.append(event)
    assert err.value.code() == grpc.StatusCode.DATA_LOSS and seen == []


def test_a_damaged_chunk_is_damaged_after_a_failed_load_and_a_put_rebuilds_it(node):
    srv, admin, a, b = node
    text = TEXT + " whose chunk is damaged"
    cid = put_text(a, text).context_id
    expected = greedy(a, cid)
    srv.decoder.evict(cid)  # DRAM forgets it: the next Generate reads the store
    flip(srv, chunk_key(cid))
    data_loss_before_any_token(a, cid)
    info = get(a, cid)
    assert info.state == pb.CONTEXT_STATE_DAMAGED and "1:k" in info.error, info
    assert rpc_code(lambda: get(b, cid)) == grpc.StatusCode.NOT_FOUND  # another tenant's, damaged or not
    assert listed(a)[cid].state == pb.CONTEXT_STATE_DAMAGED and cid not in listed(b)
    assert listed(admin)[cid].state == pb.CONTEXT_STATE_DAMAGED  # `admin list`
    data_loss_before_any_token(a, cid)  # still, until it is rebuilt
    again = a.put(pb.PutContextRequest(text=text, wait=True), timeout=60)
    assert again.created and again.context.state == pb.CONTEXT_STATE_READY, again.context.error
    assert greedy(a, cid) == expected and get(a, cid).state == pb.CONTEXT_STATE_READY
    assert admin.admin.Verify(apb.VerifyRequest(context_id=cid), metadata=admin.metadata).results[0].ok


@pytest.mark.parametrize("how", ["delete", "evict"])
def test_a_damaged_manifest_is_damaged_and_deleted_or_evicted_through_the_api(node, how):
    srv, admin, a, b = node
    text = TEXT + f" whose manifest is damaged, then {how}d"
    cid = put_text(a, text).context_id
    flip(srv, ManifestKey(cid).to_string().encode())
    data_loss_before_any_token(a, cid)
    info = get(a, cid)
    assert info.state == pb.CONTEXT_STATE_DAMAGED and "manifest" in info.error, info
    assert rpc_code(lambda: get(b, cid)) == grpc.StatusCode.NOT_FOUND
    assert listed(admin)[cid].state == pb.CONTEXT_STATE_DAMAGED and listed(a)[cid].state == pb.CONTEXT_STATE_DAMAGED
    assert not b.context.DeleteContext(pb.DeleteContextRequest(context_id=cid), metadata=b.metadata).deleted
    if how == "delete":
        assert a.context.DeleteContext(pb.DeleteContextRequest(context_id=cid), metadata=a.metadata).deleted
    else:
        assert admin.admin.Evict(apb.EvictRequest(context_id=cid), metadata=admin.metadata).evicted
    assert rpc_code(lambda: get(a, cid)) == grpc.StatusCode.NOT_FOUND and cid not in listed(admin)
    again = a.put(pb.PutContextRequest(text=text, wait=True), timeout=60)
    assert again.created and again.context.state == pb.CONTEXT_STATE_READY and len(greedy(a, cid)) == 8


def test_a_put_of_a_damaged_manifests_text_rebuilds_it(node):
    srv, _, a, _ = node
    text = TEXT + " whose manifest is damaged, then put again"
    cid = put_text(a, text).context_id
    expected = greedy(a, cid)
    srv.decoder.evict(cid)
    flip(srv, ManifestKey(cid).to_string().encode())
    again = a.put(pb.PutContextRequest(text=text, wait=True), timeout=60)  # its first read finds the damage
    assert again.created and again.context.state == pb.CONTEXT_STATE_READY, again.context.error
    assert greedy(a, cid) == expected


def test_verify_repair_marks_a_damaged_chunk_damaged(node):
    srv, admin, a, _ = node
    text = TEXT + " verified"
    cid = put_text(a, text).context_id
    flip(srv, chunk_key(cid), truncate=True)
    verify = admin.admin.Verify
    plain = verify(apb.VerifyRequest(context_id=cid), metadata=admin.metadata, timeout=30).results[0]
    assert not plain.ok and not plain.marked_damaged
    assert get(a, cid).state == pb.CONTEXT_STATE_READY  # nothing read it yet: nobody knows
    repaired = verify(apb.VerifyRequest(context_id=cid, repair=True), metadata=admin.metadata, timeout=30).results[0]
    assert not repaired.ok and repaired.marked_damaged
    info = get(a, cid)
    assert info.state == pb.CONTEXT_STATE_DAMAGED and "1:k" in info.error
    data_loss_before_any_token(a, cid)
    assert put_text(a, text).state == pb.CONTEXT_STATE_READY and len(greedy(a, cid)) == 8
