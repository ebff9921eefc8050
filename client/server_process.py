"""A real server in its own process, started as a user starts one: `python -m ctxcache.service
serve` on a port the OS picks, ready when gRPC health checking says SERVING, stopped with
SIGTERM (it drains). What the benchmarks and the end-to-end tests run against; they then talk
to it only through ctxcache.client (a process, so this module imports no server code)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

# `ctxcache serve` prints this line once its ports are bound (with --port 0: the port it got)
_SERVING = re.compile(r"serving on \S+:(\d+) ")


@contextlib.contextmanager
def running_server(flags: Sequence[str], log: Path, ready_s: float = 1800.0,
                   env: dict[str, str] | None = None, verbose: bool = False) -> Iterator[str]:
    """`ctxcache serve --host 127.0.0.1 --port 0 FLAGS`, its output in `log`; -> its address.
    ready_s: a large model loads for minutes before it serves; env: set in its environment
    (e.g. CUDA_VISIBLE_DEVICES); verbose: `ctxcache -v serve` (INFO lines in the log)."""
    with running_servers([(flags, log, env)], ready_s, verbose) as (address,):
        yield address


@contextlib.contextmanager
def running_servers(servers: Sequence[tuple[Sequence[str], Path, dict[str, str] | None]],
                    ready_s: float = 1800.0, verbose: bool = False) -> Iterator[list[str]]:
    """Several servers (flags, log, env) started at once, so their model loads and warm-ups
    overlap; -> their addresses, once every one is SERVING. All are stopped on exit."""
    procs: list[subprocess.Popen] = []
    try:
        for flags, log, env in servers:
            procs.append(_spawn(flags, log, env, verbose))
        deadline = time.monotonic() + ready_s
        yield [_wait_serving(p, log, deadline) for p, (_, log, _) in zip(procs, servers)]
    finally:
        for proc in procs:
            _stop(proc)


def _spawn(flags: Sequence[str], log: Path, env: dict[str, str] | None, verbose: bool = False) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "ctxcache.service", *(["-v"] if verbose else []), "serve",
           "--host", "127.0.0.1", "--port", "0", *flags]
    # a private loopback server: tokens set in the shell would lock out the benchmark's client
    env = {**{k: v for k, v in os.environ.items() if k not in ("CTXCACHE_TOKEN", "CTXCACHE_TENANT_TOKENS")},
           **(env or {})}
    with open(log, "w") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)


def _wait_serving(proc: subprocess.Popen, log: Path, deadline: float) -> str:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ctxcache serve exited with {proc.returncode} before serving: {_tail(log)}")
        found = _SERVING.search(log.read_text(errors="replace"))
        if found and _health(f"127.0.0.1:{found[1]}") == health_pb2.HealthCheckResponse.SERVING:
            return f"127.0.0.1:{found[1]}"
        time.sleep(0.2)
    raise TimeoutError(f"ctxcache serve was not SERVING within its deadline: {_tail(log)}")


def _health(address: str) -> int | None:
    with grpc.insecure_channel(address) as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        except grpc.RpcError:
            return None


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _tail(log: Path, lines: int = 5) -> str:
    """The last lines of the server's output, on one line (its error, or the traceback's end)."""
    text = log.read_text(errors="replace").strip().splitlines()
    return " | ".join(text[-lines:]) or "(no output)"
