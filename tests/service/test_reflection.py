"""A generic client with nothing but the server's reflection lists services and calls Generate."""

from __future__ import annotations

import grpc
from google.protobuf import descriptor_pool, json_format, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from service_helpers import put_text


def test_reflection_only_client_calls_generate(start):
    srv, client = start()
    cid = put_text(client).context_id
    channel = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
    db = ProtoReflectionDescriptorDatabase(channel)
    services = db.get_services()
    assert {"ctxcache.v1.ContextService", "ctxcache.v1.AdminService", "grpc.health.v1.Health"} <= set(services)
    pool = descriptor_pool.DescriptorPool(db)  # resolves everything through reflection, no _pb2
    method = pool.FindServiceByName("ctxcache.v1.ContextService").methods_by_name["Generate"]
    Req = message_factory.GetMessageClass(method.input_type)
    Resp = message_factory.GetMessageClass(method.output_type)
    req = json_format.ParseDict({"context_id": cid, "question": "Where?", "sampling": {"max_tokens": 4}}, Req())
    call = channel.unary_stream("/ctxcache.v1.ContextService/Generate", request_serializer=Req.SerializeToString,
                                response_deserializer=Resp.FromString)
    events = [json_format.MessageToDict(e) for e in call(req, timeout=30)]
    assert "final" in events[-1] and events[-1]["final"]["usage"]["generatedTokens"] >= 1
    channel.close()
