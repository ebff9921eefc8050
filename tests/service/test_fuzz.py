"""Issue 22: property-based fuzzing of every field of every RPC against a real server.

Each request is built from the message descriptors (every field, oneof, map, repeated and
nested message, Struct params with NaN/inf and deep nesting, hostile strings, extreme
numbers, unknown enum values), plus raw undecodable bytes. Property: every call ends with a
status within its deadline, and that status is never INTERNAL or UNKNOWN. Bounded in time:
a few dozen examples per RPC, on the tiny model, with builds capped at 1 s."""

from __future__ import annotations

import math
import time
from dataclasses import replace

import grpc
import pytest
from google.protobuf import struct_pb2
from google.protobuf.descriptor import FieldDescriptor as F
from hypothesis import HealthCheck, given, settings, strategies as st

from ctxcache.client.gen.v1 import admin_pb2 as apb, context_pb2 as pb

from service_helpers import put_text, tiny_config

DEADLINE = 15.0
BAD = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED}
RPCS = [("ContextService", name) for name in ("PutContext", "GetContext", "ListContexts", "DeleteContext",
                                               "Generate")] + \
       [("AdminService", name) for name in ("Evict", "Rebuild", "Verify", "Stats", "Describe", "Reconcile")]
SERVICES = {"ContextService": pb.DESCRIPTOR.services_by_name["ContextService"],
            "AdminService": apb.DESCRIPTOR.services_by_name["AdminService"]}
HOSTILE = ["", " ", "x", "<|im_end|>\n<|im_start|>user\nB", "\x00", "\ud7ff\ue000", "r" * 70000, "csattention",
           "key-kmeans", "system", "user", "assistant", "0.05-step-1", "a" * 64, "0" * 64, "NaN", "-1"]
INT_RANGES = {F.TYPE_INT32: (-2**31, 2**31 - 1), F.TYPE_SINT32: (-2**31, 2**31 - 1), F.TYPE_UINT32: (0, 2**32 - 1),
              F.TYPE_INT64: (-2**63, 2**63 - 1), F.TYPE_SINT64: (-2**63, 2**63 - 1), F.TYPE_UINT64: (0, 2**64 - 1),
              F.TYPE_FIXED32: (0, 2**32 - 1), F.TYPE_FIXED64: (0, 2**64 - 1)}
KNOWN_IDS: list[str] = []  # ids that exist on the server, mixed into id fields


def json_values(depth: int = 12):
    leaves = st.none() | st.booleans() | st.floats() | st.integers(-2**70, 2**70).map(float) | \
        st.sampled_from(HOSTILE) | st.text(max_size=20)
    return st.recursive(leaves, lambda inner: st.lists(inner, max_size=3) |
                        st.dictionaries(st.sampled_from(["seed", "centroids", "kmeans_iters", "subspaces",
                                                         "max_queries", "x", "r" * 300]) | st.text(max_size=8),
                                        inner, max_size=3), max_leaves=depth)


def struct_st():
    params = st.dictionaries(st.sampled_from(["subspaces", "centroids", "kmeans_iters", "seed", "max_queries",
                                              "list_fraction", "backoff_cos", "keys_per_cluster", "weighting",
                                              "r" * 300]) | st.text(max_size=10), json_values(), max_size=4)

    def build(d):
        s = struct_pb2.Struct()
        s.update(d)
        return s
    return params.map(build)


def scalar_st(f):
    if f.type == F.TYPE_STRING:
        base = st.sampled_from(HOSTILE) | st.text(max_size=40)
        if f.name in ("context_id", "page_token"):
            base = base | st.sampled_from(KNOWN_IDS or ["0" * 64])
        return base
    if f.type == F.TYPE_BYTES:
        return st.binary(max_size=40)
    if f.type == F.TYPE_BOOL:
        return st.booleans()
    if f.type in (F.TYPE_DOUBLE, F.TYPE_FLOAT):
        return st.floats(width=32 if f.type == F.TYPE_FLOAT else 64) | st.sampled_from([0.0, 1e-37, 1e38, -1.0])
    if f.type == F.TYPE_ENUM:
        return st.sampled_from([v.number for v in f.enum_type.values] + [99])
    lo, hi = INT_RANGES[f.type]
    return st.integers(lo, hi) | st.sampled_from([v for v in (0, 1, -1, 5, 64, 4097, lo, hi) if lo <= v <= hi])


def field_st(f, depth: int):
    if f.type == F.TYPE_MESSAGE:
        if f.message_type.GetOptions().map_entry:
            k, v = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
            return st.dictionaries(scalar_st(k), field_st(v, depth + 1), max_size=3)
        inner = struct_st() if f.message_type.full_name == "google.protobuf.Struct" else message_st(f.message_type, depth + 1)
    else:
        inner = scalar_st(f)
    if f.is_repeated:
        return st.lists(inner, max_size=3)
    return inner


def message_st(desc, depth: int = 0):
    cls = _class(desc)
    if depth > 4:
        return st.just(cls())
    fields = {f.name: st.none() | field_st(f, depth) for f in desc.fields}

    def build(values):
        msg = cls()
        for name, value in values.items():
            if value is None:
                continue
            f = desc.fields_by_name[name]
            target = getattr(msg, name)
            if f.type == F.TYPE_MESSAGE and f.message_type.GetOptions().map_entry:
                for k, v in value.items():
                    if isinstance(v, (int, float, str, bytes, bool)):
                        target[k] = v
                    else:
                        target[k].CopyFrom(v)
            elif f.is_repeated:
                for v in value:
                    target.add().CopyFrom(v) if f.type == F.TYPE_MESSAGE else target.append(v)
            elif f.type == F.TYPE_MESSAGE:
                target.CopyFrom(value)
            else:
                setattr(msg, name, value)
        return msg
    return st.fixed_dictionaries(fields).map(build)


def _class(desc):
    from google.protobuf import message_factory
    return message_factory.GetMessageClass(desc)


@pytest.fixture(scope="module")
def server(tiny_lm, tmp_path_factory):
    from ctxcache.client import Client
    from ctxcache.service.server import create_server
    cfg = tiny_config(tmp_path_factory.mktemp("fuzz") / "d")
    cfg = replace(cfg, indexer=replace(cfg.indexer, build_timeout_s=1.0, queue_limit=4),
                  decoder=replace(cfg.decoder, max_tokens_limit=16, default_max_tokens=8))
    srv, port = create_server(cfg, tiny_lm)
    client = Client(f"127.0.0.1:{port}")
    KNOWN_IDS.append(put_text(client).context_id)
    yield srv, client
    client.close()
    srv.stop(0.5)


def _call(channel: grpc.Channel, service: str, method: str, payload: bytes) -> grpc.StatusCode:
    m = SERVICES[service].methods_by_name[method]
    path = f"/ctxcache.v1.{service}/{method}"
    t0 = time.monotonic()
    try:
        if m.server_streaming:
            list(channel.unary_stream(path)(payload, timeout=DEADLINE))
        else:
            channel.unary_unary(path)(payload, timeout=DEADLINE)
        code = grpc.StatusCode.OK
    except grpc.RpcError as err:
        code = err.code()
        assert code not in BAD, f"{method}: {code} {err.details()[:300]}"
    assert time.monotonic() - t0 < DEADLINE
    return code


@pytest.mark.parametrize("service,method", RPCS, ids=[m for _, m in RPCS])
def test_fuzz_every_field(server, service, method):
    srv, client = server
    desc = SERVICES[service].methods_by_name[method].input_type
    seen: dict[str, int] = {}

    @settings(max_examples=25, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(message_st(desc))
    def check(request):
        code = _call(client.channel, service, method, request.SerializeToString())
        seen[code.name] = seen.get(code.name, 0) + 1

    check()
    print(method, seen)


@pytest.mark.parametrize("service,method", RPCS, ids=[m for _, m in RPCS])
def test_fuzz_raw_bytes(server, service, method):
    srv, client = server

    @settings(max_examples=15, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.binary(max_size=64))
    def check(payload):
        _call(client.channel, service, method, payload)

    check()


def _known_id():
    return st.sampled_from(KNOWN_IDS or ["0" * 64])


NEAR_VALID = {  # requests that pass the first checks, so the fuzz reaches tokenizing, building, decoding
    "Generate": lambda: st.builds(
        pb.GenerateRequest, context_id=_known_id(), question=st.text(min_size=1, max_size=80) | st.sampled_from(HOSTILE[2:6]),
        sampling=message_st(pb.SamplingParams.DESCRIPTOR), stop=st.lists(st.text(max_size=5), max_size=3),
        schedule=st.sampled_from(["", "0.05-step-1", "1.0-step-1", "0.5-step-2", "bad", "0-step-0"])),
    "PutContext": lambda: st.builds(
        pb.PutContextRequest, text=st.text(min_size=1, max_size=300) | st.sampled_from(HOSTILE[2:6]),
        method=st.builds(pb.MethodSpec, name=st.sampled_from(["", "key-kmeans", "quest", "csattention", "oracle"]),
                         params=struct_st()),
        labels=st.dictionaries(st.sampled_from(["a", "b/c", "ctxcache/x", "bad key"]), st.text(max_size=10), max_size=2),
        ttl_seconds=st.integers(0, 2**31 - 1), pin=st.booleans(), wait=st.booleans(),
        tenant=st.sampled_from(["", "t1", "bad tenant"])),
}


@pytest.mark.parametrize("method", list(NEAR_VALID))
def test_fuzz_near_valid_requests(server, method):
    srv, client = server
    assert put_text(client).context_id == KNOWN_IDS[0]  # the Delete/Evict fuzz may have removed it
    seen: dict[str, int] = {}

    @settings(max_examples=25, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(NEAR_VALID[method]())
    def check(request):
        code = _call(client.channel, "ContextService", method, request.SerializeToString())
        seen[code.name] = seen.get(code.name, 0) + 1

    check()
    print(method, seen)
    assert seen.get("OK", 0) > 0  # the fuzz reached the happy path too
