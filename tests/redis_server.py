"""A private redis-server for a test: its own free port, persistence off, never a Redis already
running on the machine (e.g. on 6379). Used by the `redis_server` fixture (tests/conftest.py)."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from ctxcache.store.registries.redis_registry import RedisConfig


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """n distinct free ports: every socket stays bound until all are picked (one at a time, the
    kernel handed SeaweedFS's filer and S3 gateway the same port, and the gateway died)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def redis_binary() -> str | None:
    return shutil.which("redis-server")


class RedisServer:
    """A redis-server this test owns; stop() and start() again on the same port."""

    def __init__(self, binary: str, workdir: Path) -> None:
        self.binary, self.workdir, self.port = binary, workdir, free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 10.0) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
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
            self.proc.wait(timeout=10)
        self.proc = None

    def config(self, **kw: object) -> RedisConfig:
        return RedisConfig(port=self.port, **kw)
