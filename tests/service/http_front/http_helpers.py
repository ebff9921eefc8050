"""Servers for the HTTP front's tests: an in-process one on the tiny random model (fast, for
shapes, tenants and fuzzing) and a `ctxcache serve --http-port 0` process on the bundled model
(for answers), each on free ports of 127.0.0.1, both fronts of one server."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from ctxcache.client.server_process import running_server
from ctxcache.service.config import ServiceConfig
from ctxcache.service.server import CtxcacheServer, create_server

from service_helpers import tiny_config

_HTTP_PORT = re.compile(r"serving on \S+ \(admin \d+, http (\d+)\)")


def tiny_http_config(data: Path, **server: Any) -> ServiceConfig:
    cfg = tiny_config(data, **server)
    # small limits keep a fuzzed max_tokens from decoding for long
    return replace(cfg, server=replace(cfg.server, http_port=0),
                   decoder=replace(cfg.decoder, default_max_tokens=4, max_tokens_limit=8))


@contextlib.contextmanager
def in_process(lm, cfg: ServiceConfig) -> Iterator[tuple[CtxcacheServer, str]]:
    """-> (server, the HTTP front's base URL)."""
    srv, _ = create_server(cfg, lm)
    try:
        yield srv, f"http://127.0.0.1:{srv.http_port}"
    finally:
        srv.stop(0.5)


@contextlib.contextmanager
def serve_process(flags: list[str], log: Path) -> Iterator[tuple[str, str]]:
    """`ctxcache serve --http-port 0 FLAGS` in its own process -> (gRPC address, HTTP base URL)."""
    with running_server(["--http-port", "0", *flags], log) as address:
        found = _HTTP_PORT.search(log.read_text())
        assert found, log.read_text()[-2000:]
        base = f"http://127.0.0.1:{found[1]}"
        assert httpx.get(f"{base}/health", timeout=10).json() == {"status": "ok"}
        yield address, base


def assert_error_shape(response: httpx.Response) -> dict:
    """OpenAI's error envelope, and nothing else, on every refusal."""
    body = response.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str), err
    return err
