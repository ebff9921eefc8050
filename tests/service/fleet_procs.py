"""Real `ctxcache serve` processes for the fleet tests: each worker is the console script of
this venv on a free port of 127.0.0.1, its log in a file beside its data."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from ctxcache.client import Client

CTXCACHE = str(Path(sys.executable).parent / "ctxcache")
ADMIN_TOKEN = "fleet-admin"
TENANT_TOKENS = "alpha-token=alpha,beta-token=beta"
# random weights (seeded: every process has the same model) and a fast index
MODEL = ["--model", "random:tiny", "--method", "key-kmeans", "--store-budget-gb", "1", "--dram-cache-gb", "0.25"]
_SERVING = re.compile(r"serving on [^:]+:(\d+)")
_HTTP = re.compile(r", http (\d+)\)")


class Worker:
    def __init__(self, name: str, root: Path, role: str, redis_url: str | None, object_store: str | None,
                 *extra: str) -> None:
        self.name, self.role, self.dir = name, role, root / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.args = [CTXCACHE, "serve", *MODEL, "--port", "0", "--data", str(self.dir / "data"), "--role", role,
                     "--build-lease", "2", "--heartbeat", "0.3", *extra]
        if redis_url:
            self.args += ["--redis", redis_url]
        if object_store:
            self.args += ["--object-store", object_store]
        self.proc: subprocess.Popen | None = None
        self.port = self.http_port = 0  # http_port: with --http-port

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> "Worker":
        env = {**os.environ, "OMP_NUM_THREADS": "1", "CTXCACHE_TOKEN": ADMIN_TOKEN,
               "CTXCACHE_TENANT_TOKENS": TENANT_TOKENS}
        log = open(self.dir / "log.txt", "a")
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        log.close()
        return self

    def wait_serving(self, timeout_s: float = 90) -> "Worker":
        """Reads the `serving on host:port` line (the process prints it once it is ready)."""
        deadline = time.monotonic() + timeout_s
        line = self.proc.stdout.readline() if self.proc else ""
        m = _SERVING.search(line)
        if m is None or time.monotonic() > deadline:
            self.kill()
            raise RuntimeError(f"{self.name} did not start: {line!r}; log: {self.log()[-1500:]}")
        self.port = int(m.group(1))
        if (h := _HTTP.search(line)) is not None:
            self.http_port = int(h.group(1))
        return self

    def log(self) -> str:
        return (self.dir / "log.txt").read_text(errors="replace")

    def client(self, token: str = ADMIN_TOKEN) -> Client:
        return Client(self.address, token)

    def kill(self) -> None:
        """kill -9: no drain, no goodbye to Redis."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        self.terminate()
        self.reap()

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def reap(self) -> None:
        if self.proc is not None:
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


def start_all(workers: list[Worker], meanwhile=lambda: None) -> list[Worker]:  # noqa: ANN001
    """Start every process first, then wait for each: the imports and model loads overlap (with
    meanwhile(), e.g. another server's start)."""
    for w in workers:
        w.start()
    try:
        meanwhile()
        return [w.wait_serving() for w in workers]
    except BaseException:
        for w in workers:
            w.kill()
        raise


def stop_all(workers: list[Worker]) -> None:
    """SIGTERM to all, then wait: the drains overlap."""
    for w in workers:
        w.terminate()
    for w in workers:
        w.reap()
