"""Fixtures: real servers on 127.0.0.1:0 over real LMDB in temp dirs (the real redis-server is
tests/conftest.py's `redis_server`)."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from ctxcache.models.loader import load_model
from ctxcache.client import Client
from ctxcache.service.config import (GiB, DecoderSettings, IndexerSettings, ModelConfig, RegistrySettings,
                                     ServerConfig, ServiceConfig, StoreSettings)
from ctxcache.client.gen.v1 import context_pb2 as pb
from ctxcache.service.server import create_server

TEXT = ("The harbour of Port Averel has a lighthouse on a granite spur called the Needle. "
        "Its lens flashes white three times every fifteen seconds. ") * 4


def tiny_config(data: Path, redis_url: str | None = None, **server) -> ServiceConfig:
    """random:tiny model (byte tokenizer) + key-kmeans: builds take milliseconds. Sparse decode:
    the service tests exercise the method's path (auto decodes dense on the CPU, which
    tests/service/test_decode_mode.py covers)."""
    return ServiceConfig(server=ServerConfig(port=0, grace_seconds=1.0, **server), model=ModelConfig("random:tiny"),
                         store=StoreSettings(data, 1 * GiB), registry=RegistrySettings(redis_url),
                         indexer=IndexerSettings(method="key-kmeans"),
                         decoder=DecoderSettings(dram_cache_bytes=256 << 20, decode_mode="sparse"))


@pytest.fixture(scope="session")
def tiny_lm():
    return load_model("random:tiny")


@pytest.fixture
def start(tiny_lm, tmp_path):
    """start(config=None, **server_overrides) -> (server, Client); all stopped at teardown."""
    running = []

    def _start(config: ServiceConfig | None = None, **server):
        cfg = config or tiny_config(tmp_path / "data", **server)
        srv, port = create_server(cfg, tiny_lm if cfg.model.model == "random:tiny" else None)
        client = Client(f"127.0.0.1:{port}", cfg.server.auth_token,
                        admin_address=f"127.0.0.1:{srv.admin_port}")
        running.append((srv, client))
        return srv, client

    yield _start
    for srv, client in running:
        client.close()
        srv.stop(0.5)


def put_text(client: Client, text: str = TEXT, **kw) -> pb.ContextInfo:
    return client.put(pb.PutContextRequest(text=text, wait=True, **kw), timeout=60).context


def ask(client: Client, cid: str, question: str = "Where is the lighthouse?", max_tokens: int = 8,
        timeout: float | None = 60, **kw) -> tuple[list[pb.GenerateResponse], pb.Final]:
    events = list(client.generate(pb.GenerateRequest(
        context_id=cid, question=question, sampling=pb.SamplingParams(max_tokens=max_tokens), **kw), timeout=timeout))
    assert events and events[-1].HasField("final"), "a stream ends with exactly one final message"
    return events, events[-1].final


def rpc_code(fn) -> grpc.StatusCode | None:
    try:
        fn()
    except grpc.RpcError as err:
        return err.code()
    return None
