"""Issue 43 item 3: a hung object store (SIGSTOPped SeaweedFS: the port open, nothing answering)
fails a cold call in about the guard's deadline, not the SDK's 20 s, and the circuit breaker
fails the calls after it at once until a probe finds the store back."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ctxcache.store import StoreUnavailable
from ctxcache.store.object.object_config import ObjectStoreConfig
from ctxcache.store.object.object_store import ObjectArtifactStore
from ctxcache.store.tiers import open_tier
from ctxcache.store.tiers.guard import Breaker, GuardConfig, GuardedTier
from store_helpers import make_artifact


@pytest.mark.s3
@pytest.mark.timeout(120)
def test_a_hung_store_answers_unavailable_within_the_deadline_then_at_once(s3_server) -> None:
    store = ObjectArtifactStore(s3_server.uri(prefix="guard"), ObjectStoreConfig())  # the service's defaults
    try:
        store.put("c1", make_artifact(3))
        s3_server.pause()
        try:
            t0 = time.monotonic()
            with pytest.raises(StoreUnavailable, match="no answer within 3 s"):
                store.manifest("c1")  # a cold load's first call
            first = time.monotonic() - t0
            t0 = time.monotonic()
            with pytest.raises(StoreUnavailable, match="not tried"):
                store.fetch("c1")  # the next caller does not wait on it again
            second = time.monotonic() - t0
        finally:
            s3_server.resume()
        assert 2.9 < first < 4.0 and second < 0.1, (first, second)
        time.sleep(GuardConfig().open_s + 0.1)
        assert store.manifest("c1").context_id == "c1"  # a probe finds it back
    finally:
        store.close()


def test_the_breaker_lets_one_probe_through_after_open_s() -> None:
    now = [0.0]
    b = Breaker(2.0, clock=lambda: now[0])
    assert b.admit()
    b.failed("refused")
    assert not b.admit() and "refused" in str(b.refusal("s3://b/p", "get"))
    now[0] = 2.5
    assert b.admit() and not b.admit()  # one probe at a time
    b.failed("still refused")
    assert not b.admit()
    now[0] = 5.0
    assert b.admit()
    b.succeeded()
    assert b.admit() and b.admit()


def test_an_answer_that_is_not_an_outage_keeps_the_breaker_closed(tmp_path: Path) -> None:
    tier = GuardedTier(open_tier(f"file://{tmp_path}"), GuardConfig(call_s=0.2, open_s=60))
    with pytest.raises(ValueError):
        tier.get("../escape")
    assert tier.get("v1/absent") is None
    tier.inner.get = lambda key: time.sleep(1)  # type: ignore[method-assign]  # hangs
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable, match="no answer within 0.2 s"):
        tier.get("v1/x")
    assert time.monotonic() - t0 < 0.5
    with pytest.raises(StoreUnavailable, match="not tried"):
        tier.list("v1")
    with pytest.raises(ValueError, match="must be > 0"):
        GuardConfig(call_s=0)
