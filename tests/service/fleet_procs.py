"""Real `ctxcache serve` processes for the fleet tests: each worker is the console script of
this venv on a free port of 127.0.0.1, its log in a file beside its data. The `fleet` fixture
(two indexers, two decoders and a `--role all` reference on one Redis and one S3 server) and the
calls the fleet test files make of it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from ctxcache.client import Client
from ctxcache.client.gen.v1 import context_pb2 as pb
from ctxcache.store.registries.fleet_registry import FleetRegistry

from redis_server import RedisServer, free_port, redis_binary
from s3_server import S3Server, weed_binary

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


TEXT = "The harbour of Port Averel has a lighthouse on a granite spur called the Needle. " * 3
# CSAttention with 16 subspaces x 1024 centroids and 100 k-means iterations over ~700 tokens
# (random:tiny caches at most 768): ~2.5 s per layer on a 2-core CPU, so a build seen at 0.7
# (indexing) still has seconds to go when the delete or kill reaches it; key-kmeans with one key
# per cluster indexed both layers in ~0.4 s, and CI saw such a build finish before the delete
SLOW_METHOD, SLOW = "csattention", {"subspaces": 16, "centroids": 1024, "kmeans_iters": 100}
SLOW_TEXT = (TEXT * 3)[:680]


@dataclass
class Fleet:
    redis: RedisServer
    s3: S3Server
    indexers: list[Worker]
    a: Worker
    b: Worker
    one: Worker  # --role all: the single-node reference
    root: Path

    def registry(self) -> FleetRegistry:
        return FleetRegistry(self.redis.config())


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    if redis_binary() is None or weed_binary() is None:
        pytest.skip("needs redis-server and SeaweedFS's weed")
    root = tmp_path_factory.mktemp("fleet")
    redis, s3 = RedisServer(redis_binary(), root), S3Server(weed_binary(), root / "s3")
    redis.start()
    store = s3.uri(prefix="fleet")
    indexers = [Worker(f"ix{i}", root, "indexer", redis.url, store, "--metrics-port", str(free_port()))
                for i in (1, 2)]
    a = Worker("decA", root, "decoder", redis.url, store, "--http-port", "0")  # the HTTP front on a fleet decoder
    b = Worker("decB", root, "decoder", redis.url, store)
    one = Worker("one", root, "all", None, None)
    workers = start_all([*indexers, a, b, one], meanwhile=s3.start)  # no worker touches S3 before a Put
    try:
        yield Fleet(redis, s3, indexers, a, b, one, root)
    finally:
        stop_all(workers)
        redis.stop()
        s3.stop()


def put(worker: Worker, text: str = TEXT, token: str | None = None, wait: bool = True, slow: bool = False,
        **kw) -> pb.PutContextResponse:
    c = worker.client(token) if token else worker.client()
    req = pb.PutContextRequest(text=text, wait=wait, **kw)
    if slow:
        req.method.name = SLOW_METHOD
        req.method.params.update(SLOW)
    try:
        return c.put(req, timeout=120)
    finally:
        c.close()


def get(worker: Worker, cid: str, token: str | None = None) -> pb.ContextInfo:
    c = worker.client(token) if token else worker.client()
    try:
        return c.context.GetContext(pb.GetContextRequest(context_id=cid), metadata=c.metadata, timeout=10)
    finally:
        c.close()


def tokens(worker: Worker, cid: str, token: str | None = None, max_tokens: int = 8, timeout: float = 60,
           seen: list | None = None) -> list[int]:
    """The greedy answer's token ids; `seen` collects the stream's messages as they arrive."""
    c = worker.client(token) if token else worker.client()
    req = pb.GenerateRequest(context_id=cid, question="Where is the lighthouse?",
                             sampling=pb.SamplingParams(max_tokens=max_tokens))
    events = [] if seen is None else seen
    try:
        for e in c.generate(req, timeout=timeout):
            events.append(e)
    finally:
        c.close()
    assert events[-1].HasField("final")
    return [t for e in events if e.HasField("chunk") for t in e.chunk.token_ids]


def builds(indexer: Worker, outcome: str) -> int:
    """The indexer's own count of builds by outcome (its Prometheus endpoint)."""
    port = indexer.args[indexer.args.index("--metrics-port") + 1]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    m = re.search(rf'^ctxcache_builds_total{{outcome="{outcome}"}} ([0-9.]+)$', text, re.MULTILINE)
    return int(float(m.group(1))) if m else 0


def failure(fn) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        fn()
    return err.value


def assert_no_address(err: grpc.RpcError, part: str, *addresses: str) -> None:
    """A tenant reads which part failed, never where it lives (issue 43)."""
    assert part in err.details(), err.details()
    for address in addresses:
        assert address not in err.details(), err.details()
    assert "127.0.0.1" not in err.details(), err.details()


def wait_until(predicate, timeout_s: float, step_s: float = 0.02):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step_s)
    return predicate()
