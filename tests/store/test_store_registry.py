"""Registry: embedded and a real redis-server (started per test on a free port)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ctxcache.store import (ArtifactStore, ContextMeta, EmbeddedRegistry, RedisRegistry,
                            RegistryUnavailable, StoreConfig, reconcile)
from ctxcache.store.registries.registry import BuildState, Registry, RegistryEntry
from store_helpers import make_artifact


@pytest.fixture(params=["embedded", pytest.param("redis", marks=pytest.mark.redis)])
def make_registry(request: pytest.FixtureRequest) -> Iterator[Callable[[], Registry]]:
    """A factory: each call is another client (another 'process') of the same registry."""
    if request.param == "embedded":
        shared = EmbeddedRegistry()
        yield lambda: shared
        return
    server = request.getfixturevalue("redis_server")
    clients: list[RedisRegistry] = []

    def make() -> Registry:
        clients.append(RedisRegistry(server.config()))
        return clients[-1]
    yield make
    for c in clients:
        c.close()


def test_entries_round_trip(make_registry: Callable[[], Registry]) -> None:
    r = make_registry()
    assert r.get("p1") is None and not r.delete("p1")
    r.put(RegistryEntry("p1", "c1", BuildState.READY, "/data", "", 12.5))
    r.put(RegistryEntry("p2", "c2", "FAILED", "", "boom", 1.0))
    assert r.get("p1") == RegistryEntry("p1", "c1", BuildState.READY, "/data", "", 12.5)
    assert sorted(e.prompt_hash for e in r.entries()) == ["p1", "p2"]
    assert r.get("p2").error == "boom" and r.delete("p2") and r.get("p2") is None
    with pytest.raises(ValueError, match="prompt_hash"):
        r.get("bad:hash")


def test_sixteen_concurrent_claims_one_winner(make_registry: Callable[[], Registry]) -> None:
    clients = [make_registry() for _ in range(16)]
    barrier, results = threading.Barrier(16), {}

    def claim(i: int) -> None:
        barrier.wait()
        results[i] = clients[i].claim_build("hash1", "ctx1", "/data")

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, won in results.items() if won]
    assert len(results) == 16 and len(winners) == 1
    r = clients[(winners[0] + 1) % 16]
    assert r.get("hash1").state == BuildState.BUILDING and r.build_claimed("hash1")
    clients[winners[0]].mark_ready("hash1", "ctx1", "/data")
    assert not any(c.claim_build("hash1", "ctx1") for c in clients)  # READY: no second build
    assert r.get("hash1").state == BuildState.READY


def test_claim_lifecycle(make_registry: Callable[[], Registry]) -> None:
    a, b = make_registry(), make_registry()
    assert a.claim_build("h", "c", lease_s=30)
    assert not b.claim_build("h", "c")
    a.mark_failed("h", "c", "out of memory")
    assert b.get("h").state == BuildState.FAILED and not b.build_claimed("h")
    assert b.claim_build("h", "c", lease_s=30)  # a failed build may be retried
    b.mark_ready("h", "c", "/data")
    assert not a.claim_build("h", "c") and a.get("h").state == BuildState.READY
    assert a.claim_build("other", "c2", lease_s=0.2)
    time.sleep(0.3)  # the claimer died: its lease lapses
    assert b.claim_build("other", "c2", lease_s=30)


def test_renewed_claim_outlives_its_lease_and_lapses_once_not_renewed(
        make_registry: Callable[[], Registry]) -> None:
    a, b = make_registry(), make_registry()
    assert a.claim_build("h", "c", lease_s=0.3)
    for _ in range(4):  # 0.6 s of heartbeats: twice the lease
        time.sleep(0.15)
        assert a.renew_build("h", lease_s=0.3)
    assert not b.claim_build("h", "c") and b.build_claimed("h")
    time.sleep(0.4)  # the builder died: no more renewals, the claim lapses
    assert not a.renew_build("h", lease_s=0.3)
    assert b.claim_build("h", "c", lease_s=30)
    if isinstance(a, RedisRegistry):  # claims are owned: another worker cannot extend them
        assert not a.renew_build("h")


@pytest.mark.redis
def test_redis_down_fails_fast_and_recovers(redis_server, tmp_path: Path) -> None:  # noqa: ANN001
    reg = RedisRegistry(redis_server.config())
    reg.mark_ready("h1", "c1", "/data")
    redis_server.stop()
    for call in (lambda: reg.get("h1"), lambda: reg.claim_build("h2", "c2"),
                 lambda: list(reg.entries()), reg.ping):
        t = time.monotonic()
        with pytest.raises(RegistryUnavailable, match="unavailable"):
            call()
        assert time.monotonic() - t < 1.0
    redis_server.start()
    assert reg.ping() and reg.get("h1") is None  # same client reconnects; data was not saved
    assert reg.claim_build("h2", "c2")
    with ArtifactStore(tmp_path / "s", StoreConfig(map_size_bytes=64 << 20,
                                                   budget_bytes=32 << 20)) as store:
        store.put("c1", make_artifact(1), ContextMeta(prompt_hash="h1"))
        assert reconcile(reg, store).added == ("h1",)  # Redis was never the only copy
    assert reg.get("h1").context_id == "c1" and reg.get("h1").state == BuildState.READY


@pytest.mark.redis
def test_redis_hung_fails_fast(redis_server) -> None:  # noqa: ANN001
    reg = RedisRegistry(redis_server.config())
    assert reg.ping()
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        t = time.monotonic()
        with pytest.raises(RegistryUnavailable):
            reg.get("h1")
        elapsed = time.monotonic() - t
        assert elapsed < reg.config.worst_case_s() + 0.3 < 2.0, elapsed
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    assert reg.ping()


def test_reconcile_rebuilds_from_lmdb(make_registry: Callable[[], Registry], tmp_path: Path) -> None:
    r = make_registry()
    with ArtifactStore(tmp_path / "s", StoreConfig(map_size_bytes=64 << 20,
                                                   budget_bytes=32 << 20)) as store:
        store.put("c1", make_artifact(1), ContextMeta(prompt_hash="h1"))
        store.put("c2", make_artifact(2))  # no prompt hash: keyed by its context id
        store.put("c3", make_artifact(3), ContextMeta(prompt_hash="h3"))
        here = store.location
        r.put(RegistryEntry("h1", "c1", BuildState.READY, here))
        r.put(RegistryEntry("gone", "c9", BuildState.READY, here))  # artifact missing
        r.put(RegistryEntry("crashed", "c3", BuildState.BUILDING, here))  # builder died
        r.put(RegistryEntry("lost", "c8", BuildState.BUILDING, here))  # died before commit
        r.put(RegistryEntry("bad", "c7", BuildState.FAILED, here, "oom"))
        r.put(RegistryEntry("far", "c6", BuildState.READY, "other-host:/data"))
        rep = reconcile(r, store)
        assert sorted(rep.removed) == ["gone", "lost"] and rep.foreign == 1
        assert sorted(rep.added) == ["c2", "h3"]
        states = {e.prompt_hash: (e.context_id, e.state) for e in r.entries()}
        assert states == {"h1": ("c1", "READY"), "c2": ("c2", "READY"), "h3": ("c3", "READY"),
                          "crashed": ("c3", "READY"), "bad": ("c7", "FAILED"),
                          "far": ("c6", "READY")}
        assert reconcile(r, store).added == () and reconcile(r, store).removed == ()


def test_registry_imports_no_torch() -> None:
    code = ("import sys, ctxcache.store.registries.registry, ctxcache.store.registries.redis_registry, "
            "ctxcache.store.keys, ctxcache.store.ids; assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
