"""Issue 22 #7, #8, #10: hostile input is INVALID_ARGUMENT, quickly, with a bounded message."""

from __future__ import annotations

import time

import grpc
import pytest
from google.protobuf import struct_pb2

from ctxcache.client.gen.v1 import context_pb2 as pb

from service_helpers import put_text, rpc_code

BIG = "r" * 65536


def _params(**kw) -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    s.update(kw)
    return s


def _details(fn) -> tuple[grpc.StatusCode, str]:
    try:
        fn()
    except grpc.RpcError as err:
        return err.code(), err.details()
    return grpc.StatusCode.OK, ""


@pytest.mark.parametrize("build", [
    lambda cid: pb.PutContextRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role=BIG, content="x")])),
    lambda cid: pb.PutContextRequest(text="x", method=pb.MethodSpec(name=BIG)),
    lambda cid: pb.PutContextRequest(text="x", method=pb.MethodSpec(name="key-kmeans", params=_params(**{BIG: 1}))),
    lambda cid: pb.GenerateRequest(context_id=cid, question="q", schedule=BIG),
    lambda cid: pb.GenerateRequest(context_id=cid, chat=pb.ChatMessages(messages=[pb.ChatMessage(role=BIG, content="x")])),
], ids=["role", "method.name", "param key", "schedule", "generate role"])
def test_echoed_values_are_cut(start, build):
    srv, client = start()
    cid = put_text(client).context_id
    req = build(cid)
    call = client.put if isinstance(req, pb.PutContextRequest) else (lambda r, timeout: list(client.generate(r, timeout)))
    code, details = _details(lambda: call(req, timeout=5))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and len(details) <= 1100, (code, len(details))


def test_oversized_text_is_refused_before_tokenizing(start):
    srv, client = start()
    for req in (pb.PutContextRequest(text="y" * (10 << 20)),
                pb.GenerateRequest(context_id="0" * 64, question="y" * (10 << 20))):
        t0 = time.perf_counter()
        call = client.put if isinstance(req, pb.PutContextRequest) else (lambda r, timeout: list(client.generate(r, timeout)))
        code, details = _details(lambda: call(req, timeout=30))
        took = time.perf_counter() - t0
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "counted without tokenizing" in details, details
        assert took < 1.0, took  # 10 MB tokenized took 11-14 s


@pytest.mark.parametrize("raw", [b"\x0a\x05\xff\xfe\xfd\xfc\xfb", b"\x0a\xff", b"\xff\xff\xff\xff", b"\x12\x80"],
                         ids=["invalid utf-8", "truncated", "garbage", "bad length"])
def test_undecodable_requests_are_invalid_argument(start, raw):
    srv, client = start()
    for method in ("/ctxcache.v1.ContextService/PutContext", "/ctxcache.v1.ContextService/GetContext"):
        call = client.channel.unary_unary(method)
        assert rpc_code(lambda: call(raw, timeout=5)) == grpc.StatusCode.INVALID_ARGUMENT
    stream = client.channel.unary_stream("/ctxcache.v1.ContextService/Generate")
    assert rpc_code(lambda: list(stream(raw, timeout=5))) == grpc.StatusCode.INVALID_ARGUMENT


def test_deeply_nested_params_and_tiny_temperature_are_invalid_argument(start):
    srv, client = start()
    cid = put_text(client).context_id
    nested: dict = {"x": 1}
    for _ in range(20):  # deeper than the server's limit, within what a Python client can build
        nested = {"n": nested}
    req = pb.PutContextRequest(text="x", method=pb.MethodSpec(name="key-kmeans", params=_params(deep=nested)))
    assert rpc_code(lambda: client.put(req, timeout=5)) == grpc.StatusCode.INVALID_ARGUMENT
    call = client.channel.unary_unary("/ctxcache.v1.ContextService/PutContext")  # 60 levels, as raw bytes
    assert rpc_code(lambda: call(_nested_put(60), timeout=5)) == grpc.StatusCode.INVALID_ARGUMENT
    gen = pb.GenerateRequest(context_id=cid, question="q", sampling=pb.SamplingParams(temperature=1e-37))
    assert rpc_code(lambda: list(client.generate(gen, timeout=10))) == grpc.StatusCode.INVALID_ARGUMENT


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (wire type 2)."""
    n, varint = len(payload), b""
    while True:
        byte, n = n & 0x7F, n >> 7
        varint += bytes([byte | (0x80 if n else 0)])
        if not n:
            break
    return bytes([number << 3 | 2]) + varint + payload


def _nested_put(depth: int) -> bytes:
    """PutContextRequest{text: "x", method: {name: "key-kmeans", params: {n: {n: ... }}}} as bytes."""
    struct = b""
    for _ in range(depth):  # Struct.fields[ "n" ] = Value{struct_value: struct}
        struct = _field(1, _field(1, b"n") + _field(2, _field(5, struct)))
    req = pb.PutContextRequest(text="x").SerializeToString()
    method = pb.MethodSpec(name="key-kmeans").SerializeToString() + _field(2, struct)
    return req + _field(pb.PutContextRequest.DESCRIPTOR.fields_by_name["method"].number, method)
