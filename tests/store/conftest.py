"""Fixtures for store tests: temp LMDB stores and a private redis-server per test.

The Redis fixture starts its own `redis-server` on a free port with persistence off and never
touches a Redis already running on the machine (e.g. on 6379). Tests skip if the binary is
missing.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ctxcache.store.redis_registry import RedisConfig


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A redis-server this test owns; stop() and start() again on the same port."""

    def __init__(self, binary: str, port: int) -> None:
        self.binary, self.port = binary, port
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 5.0) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.1) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a test may have paused it
            self.proc.terminate()
            self.proc.wait(timeout=5)
        self.proc = None

    def config(self, **kw: object) -> RedisConfig:
        return RedisConfig(port=self.port, **kw)


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server binary not found")
    server = RedisServer(binary, _free_port())
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    return tmp_path / "store"
