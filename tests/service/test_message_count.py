"""Issue 29 #5: a chat of many tiny messages is refused by its size before it is tokenized (the
pre-check counts the chat template's tokens per message, not the content's characters only)."""

from __future__ import annotations

import time
from dataclasses import replace

import grpc
import pytest

from ctxcache.client import Client
from ctxcache.client.gen.v1 import context_pb2 as pb
from ctxcache.service.config import ModelConfig
from ctxcache.prompting import Prompter
from ctxcache.service.server import create_server
from service_helpers import tiny_config


def _chat(n: int) -> pb.ChatMessages:
    return pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="x")] * n)


@pytest.fixture
def smol_client(smollm2, tmp_path):
    srv, port = create_server(replace(tiny_config(tmp_path / "d"), model=ModelConfig("smollm2")), smollm2)
    client = Client(f"127.0.0.1:{port}")
    yield srv, client
    client.close()
    srv.stop(0.5)


def test_240k_tiny_messages_are_refused_untokenized(smol_client):
    _, client = smol_client
    for rpc, req in (("put", pb.PutContextRequest(chat=_chat(240_000), wait=True)),
                     ("generate", pb.GenerateRequest(context_id="0" * 64, chat=_chat(240_000)))):
        t0 = time.perf_counter()
        with pytest.raises(grpc.RpcError) as err:
            if rpc == "put":
                client.put(req, timeout=60)
            else:
                list(client.generate(req, timeout=60))
        took = time.perf_counter() - t0
        print(f"{rpc}: 240,000 messages refused in {took:.2f}s: {err.value.details()}")
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "template tokens per message" in err.value.details()
        assert took < 3.0, took  # was 12 s of tokenizing


def test_a_chat_at_the_bound_is_accepted_and_one_more_message_refused(smollm2, smol_client):
    srv, client = smol_client
    p, limit = Prompter(smollm2.tokenizer), srv.indexer.max_tokens
    assert p.message_tokens >= 3  # ChatML: <|im_start|>, role, newline, <|im_end|>, newline
    def fits(k: int) -> bool:
        return len(p.context_tokens([{"role": "user", "content": "x"}] * k)) <= limit

    n = limit // (p.message_tokens + 1)
    while not fits(n):
        n -= 1
    while fits(n + 1):
        n += 1  # n: the most messages that fit; the pre-check must not refuse them
    assert client.put(pb.PutContextRequest(chat=_chat(n), wait=False), timeout=60).context.n_tokens <= limit
    with pytest.raises(grpc.RpcError) as err:
        client.put(pb.PutContextRequest(chat=_chat(n + 1), wait=False), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
