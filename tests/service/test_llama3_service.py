"""A Llama-3-shaped model (rope scaling, a tuple that the manifest stores as a list) serves
PutContext -> Generate on the CPU reference path, also from a restarted server (a cold store)."""

from __future__ import annotations

import dataclasses

from ctxcache.client import Client
from ctxcache.client.gen.v1 import context_pb2 as pb
from ctxcache.models.loader import load_model
from ctxcache.service.config import ModelConfig
from ctxcache.service.server import create_server
from service_helpers import ask, put_text, tiny_config


def _serve(cfg, lm):
    srv, port = create_server(cfg, lm)
    return srv, Client(f"127.0.0.1:{port}", cfg.server.auth_token, admin_address=f"127.0.0.1:{srv.admin_port}")


def test_llama3_scaled_model_put_then_generate(tmp_path):
    lm = load_model("random:tiny-llama3")
    cfg = dataclasses.replace(tiny_config(tmp_path / "data"), model=ModelConfig("random:tiny-llama3"))
    answers = []
    for _ in range(2):  # the second server finds the context in the store only
        srv, client = _serve(cfg, lm)
        try:
            info = put_text(client)
            assert info.state == pb.CONTEXT_STATE_READY
            _, final = ask(client, info.context_id, max_tokens=4)
            assert final.decode_path == "reference" and final.usage.generated_tokens >= 1, final
            answers.append(final.text)
        finally:
            client.close()
            srv.stop(0.5)
    assert answers[0] == answers[1]
