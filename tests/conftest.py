"""Fixtures and markers shared by every test folder.

Markers (pyproject.toml): `slow` tests are deselected by default (`-m slow` runs them); `gpu`
tests skip without CUDA, `redis` tests without a redis-server binary, each with the reason."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # kernels run in Triton's CPU interpreter; set before any import

from redis_server import RedisServer, redis_binary  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    missing = {"gpu": None if torch.cuda.is_available() else "needs a CUDA GPU",
               "redis": None if redis_binary() else "needs a redis-server binary"}
    for item in items:
        for name, why in missing.items():
            mark = item.get_closest_marker(name)
            if mark is not None and why is not None:
                reason = mark.kwargs.get("reason")
                item.add_marker(pytest.mark.skip(reason=f"{why}: {reason}" if reason else why))


@pytest.fixture
def device() -> str:
    """Where kernel and GPU-build tests run: the GPU, or the CPU (through the interpreter)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="session")
def smollm2():
    """The bundled SmolLM2 model, loaded once for the whole run (skips where it is not installed)."""
    from ctxcache.models.loader import load_model
    try:
        return load_model("smollm2")
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture
def redis_server(tmp_path) -> Iterator[RedisServer]:
    """A started private redis-server (skips without the binary; tests using it are marked redis)."""
    binary = redis_binary()
    if binary is None:
        pytest.skip("redis-server binary not found")
    server = RedisServer(binary, tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()
