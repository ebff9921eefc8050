"""Table-driven malformed inputs: every RPC field answered with the right code naming the field."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import struct_pb2

from ctxcache.client.gen.v1 import admin_pb2 as apb, context_pb2 as pb

from service_helpers import put_text

ID0 = "0" * 64
INVALID = grpc.StatusCode.INVALID_ARGUMENT


def _struct(**kw) -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    s.update(kw)
    return s


def _gen(**kw) -> pb.GenerateRequest:
    base = {"context_id": "{cid}", "question": "q?"}
    return pb.GenerateRequest(**{**base, **kw})


PUT_CASES = [
    (pb.PutContextRequest(), INVALID, "content"),
    (pb.PutContextRequest(text="   "), INVALID, "text"),
    (pb.PutContextRequest(chat=pb.ChatMessages()), INVALID, "chat.messages"),
    (pb.PutContextRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="robot", content="x")])),
     INVALID, "chat.messages[0].role"),
    (pb.PutContextRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="")])),
     INVALID, "chat.messages[0].content"),
    (pb.PutContextRequest(documents=pb.Documents()), INVALID, "documents.documents"),
    (pb.PutContextRequest(documents=pb.Documents(documents=[pb.Document(id="a", text="")])),
     INVALID, "documents.documents[0].text"),
    (pb.PutContextRequest(text="x", labels={"bad key!": "v"}), INVALID, "labels"),
    (pb.PutContextRequest(text="x", labels={"ctxcache/roles": "v"}), INVALID, "labels"),
    (pb.PutContextRequest(text="x", labels={"k": "v" * 300}), INVALID, "labels"),
    (pb.PutContextRequest(text="x", tenant="no spaces"), INVALID, "tenant"),
    (pb.PutContextRequest(text="x", method=pb.MethodSpec(name="nope")), INVALID, "method.name"),
    (pb.PutContextRequest(text="x", method=pb.MethodSpec(name="key-kmeans", params=_struct(bogus=1))),
     INVALID, "method.params"),
    (pb.PutContextRequest(text="x", method=pb.MethodSpec(name="csattention", params=_struct(subspaces=-3))),
     INVALID, "method.params"),
    (pb.PutContextRequest(text="y" * 5000), INVALID, "content"),  # over the model's length
]

GEN_CASES = [
    (pb.GenerateRequest(context_id="", question="q"), INVALID, "context_id"),
    (pb.GenerateRequest(context_id="XYZ", question="q"), INVALID, "context_id"),
    (pb.GenerateRequest(context_id=ID0, question="q"), grpc.StatusCode.NOT_FOUND, "not found"),
    (_gen(question=None), INVALID, "turn"),
    (_gen(question=" "), INVALID, "question"),
    (_gen(question=None, chat=pb.ChatMessages(messages=[pb.ChatMessage(role="assistant", content="hi")])),
     INVALID, "chat.messages"),
    (_gen(question=None, chat=pb.ChatMessages(messages=[pb.ChatMessage(role="x", content="hi")])),
     INVALID, "chat.messages[0].role"),
    (_gen(sampling=pb.SamplingParams(temperature=-1)), INVALID, "sampling.temperature"),
    (_gen(sampling=pb.SamplingParams(temperature=float("nan"))), INVALID, "sampling.temperature"),
    (_gen(sampling=pb.SamplingParams(top_p=1.5)), INVALID, "sampling.top_p"),
    (_gen(sampling=pb.SamplingParams(top_p=-0.1)), INVALID, "sampling.top_p"),
    (_gen(sampling=pb.SamplingParams(max_tokens=10**6)), INVALID, "sampling.max_tokens"),
    (_gen(stop=[""]), INVALID, "stop[0]"),
    (_gen(stop=["s"] * 9), INVALID, "stop"),
    (_gen(stop=["x" * 65]), INVALID, "stop[0]"),
    (_gen(schedule="fast please"), INVALID, "schedule"),
    (_gen(question="q" * 2000), INVALID, "question"),  # context + question over the model's length
]


@pytest.fixture
def served(start):
    srv, client = start()
    return client, put_text(client).context_id


def _fill(req, cid):
    if hasattr(req, "context_id") and req.context_id == "{cid}":
        req.context_id = cid
    return req


def _check(call, code, field):
    with pytest.raises(grpc.RpcError) as err:
        result = call()
        if hasattr(result, "__next__"):
            list(result)
    assert err.value.code() == code, err.value.details()
    assert field in err.value.details(), err.value.details()


def test_put_context_fields(served):
    client, _ = served
    for req, code, field in PUT_CASES:
        _check(lambda: client.put(req, timeout=30), code, field)


def test_generate_fields(served):
    client, cid = served
    for req, code, field in GEN_CASES:
        _check(lambda: client.generate(_fill(req, cid), timeout=30), code, field)


def test_other_rpc_fields(served):
    client, cid = served
    c, a = client.context, client.admin
    cases = [
        (lambda: c.GetContext(pb.GetContextRequest(context_id="nope")), INVALID, "context_id"),
        (lambda: c.GetContext(pb.GetContextRequest(context_id=ID0)), grpc.StatusCode.NOT_FOUND, ID0),
        (lambda: c.ListContexts(pb.ListContextsRequest(page_size=5000)), INVALID, "page_size"),
        (lambda: c.ListContexts(pb.ListContextsRequest(page_token="garbage")), INVALID, "page_token"),
        (lambda: c.DeleteContext(pb.DeleteContextRequest(context_id="")), INVALID, "context_id"),
        (lambda: a.Evict(apb.EvictRequest(context_id="zz")), INVALID, "context_id"),
        (lambda: a.Evict(apb.EvictRequest(context_id=cid, memory_only=True, device_only=True)), INVALID,
         "device_only"),
        (lambda: a.Describe(apb.DescribeRequest(context_id="zz")), INVALID, "context_id"),
        (lambda: a.Describe(apb.DescribeRequest(context_id=ID0)), grpc.StatusCode.NOT_FOUND, ID0),
        (lambda: a.Verify(apb.VerifyRequest(context_id="zz")), INVALID, "context_id"),
        (lambda: a.Verify(apb.VerifyRequest(context_id=ID0)), grpc.StatusCode.NOT_FOUND, ID0),
        (lambda: a.Rebuild(apb.RebuildRequest(context_id="zz")), INVALID, "context_id"),
        (lambda: a.Rebuild(apb.RebuildRequest(context_id=ID0)), grpc.StatusCode.NOT_FOUND, ID0),
        (lambda: a.Rebuild(apb.RebuildRequest(context_id=cid, method=pb.MethodSpec(name="nope"))),
         INVALID, "method.name"),
    ]
    for call, code, field in cases:
        _check(call, code, field)
    assert not c.DeleteContext(pb.DeleteContextRequest(context_id=ID0)).deleted


def test_oversized_message_is_refused(tmp_path, start):
    from service_helpers import tiny_config

    srv, client = start(tiny_config(tmp_path / "small", max_message_bytes=4096))
    _check(lambda: client.put(pb.PutContextRequest(text="z" * 10000), timeout=30),
           grpc.StatusCode.RESOURCE_EXHAUSTED, "")
