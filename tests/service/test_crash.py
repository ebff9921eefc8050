"""kill -9 of the server during PutContext at >= 20 random points: the store opens cleanly, no
partial artifact is listed or served, and after reconcile the registry never points at a
missing artifact."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import threading
import time

import grpc
import pytest

from ctxcache.client import Client
from ctxcache.client.gen.v1 import context_pb2 as pb
from ctxcache.store import ArtifactStore, BuildState, RedisRegistry, reconcile

import crash_child
from redis_server import RedisServer, redis_binary
from service_helpers import TEXT, ask, tiny_config

KILLS = int(os.environ.get("CTXCACHE_CRASH_KILLS", "20"))


@pytest.fixture(scope="module")
def forkserver():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "grpc", "ctxcache.service.server", "conftest", "crash_child"])
    return ctx


def _start_child(ctx, data, redis_url):
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=crash_child.serve, args=(str(data), redis_url, child), daemon=True)
    proc.start()
    if not parent.poll(60):
        proc.kill()
        raise RuntimeError("server child did not start")
    return proc, parent.recv()


def _put_forever(client: Client, stop: threading.Event, in_flight: list[int], seed: int) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        text = TEXT[:rng.randint(200, 560)] + f" variant {rng.random()}"
        in_flight[0] += 1
        try:
            client.put(pb.PutContextRequest(text=text, wait=True), timeout=30)
        except grpc.RpcError:  # the kill (UNAVAILABLE); anything else fails the counts below
            return
        finally:
            in_flight[0] -= 1


def _check_store(data, registry) -> int:
    with ArtifactStore(data) as store:
        ms = store.list_manifests(limit=10_000)
        assert sorted(m.context_id for m in ms) == sorted(store.context_ids()), "a corrupt manifest is listed"
        for m in ms:
            art = store.get(m.context_id)  # raises CorruptArtifact on any partial/damaged chunk
            assert art is not None and art.n_tokens == m.n_tokens and len(art.layers) == m.n_layers
            assert store.verify(m.context_id).ok
        if registry is not None:
            reconcile(registry, store)
            for e in registry.entries():
                if e.state == BuildState.READY:
                    assert store.manifest(e.context_id) is not None, f"registry points at missing {e.context_id}"
        return len(ms)


def test_kill9_during_put_context(forkserver, tmp_path):
    redis = RedisServer(redis_binary(), tmp_path) if redis_binary() else None  # with Redis where there is one
    if redis:
        redis.start()
    registry = RedisRegistry(tiny_config(tmp_path, redis.url).registry.redis_config()) if redis else None
    data, rng, mid_build = tmp_path / "data", random.Random(1234), 0
    try:
        for i in range(KILLS):
            proc, port = _start_child(forkserver, data, redis.url if redis else None)
            client, stop, in_flight = Client(f"127.0.0.1:{port}"), threading.Event(), [0]
            worker = threading.Thread(target=_put_forever, args=(client, stop, in_flight, i))
            worker.start()
            time.sleep(rng.uniform(0.02, 0.4))
            mid_build += in_flight[0] > 0
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(10)
            stop.set()
            worker.join(30)
            client.close()
            _check_store(data, registry)
        assert mid_build >= KILLS // 2, f"only {mid_build} of {KILLS} kills hit a PutContext in flight"
        proc, port = _start_child(forkserver, data, redis.url if redis else None)  # served after restart
        client = Client(f"127.0.0.1:{port}")
        listed = client.context.ListContexts(pb.ListContextsRequest(page_size=1000)).contexts
        assert listed, "no PutContext completed across the kills: the test proves nothing"
        for info in listed[:3]:
            assert ask(client, info.context_id, max_tokens=2)[1].usage.cached_tokens == info.n_tokens
        client.close()
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
    finally:
        if registry:
            registry.close()
        if redis:
            redis.stop()
