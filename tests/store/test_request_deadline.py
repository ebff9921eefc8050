"""Issue 43 item 3, the deadline "derived from the request's": inside `request_deadline` an
object-store call ends by the request's deadline when that comes before the guard's own call_s,
with StoreDeadline (DEADLINE_EXCEEDED), and opens no circuit breaker (a client's short deadline
says nothing of the store); a longer request deadline keeps the guard's call_s."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ctxcache.store import StoreDeadline, StoreUnavailable, request_deadline
from ctxcache.store.tiers import open_tier
from ctxcache.store.tiers.guard import GuardConfig, GuardedTier


def hung_tier(tmp_path: Path, call_s: float = 3.0) -> tuple[GuardedTier, object]:
    """A file tier whose get and get_many hang for 5 s; -> (the tier, the real get to restore)."""
    tier = GuardedTier(open_tier(f"file://{tmp_path}"), GuardConfig(call_s=call_s, open_s=60))
    real = tier.inner.get
    tier.inner.get = lambda key: time.sleep(5)  # type: ignore[method-assign]
    tier.inner.get_many = lambda keys, then=None: time.sleep(5)  # type: ignore[method-assign]
    return tier, real


def timed(fn) -> float:  # noqa: ANN001
    t0 = time.monotonic()
    fn()
    return time.monotonic() - t0


def test_a_request_deadline_before_call_s_ends_the_call_then_and_opens_no_breaker(tmp_path: Path) -> None:
    tier, real = hung_tier(tmp_path)

    def get() -> None:
        with request_deadline(time.monotonic() + 1.0), pytest.raises(StoreDeadline, match="request's deadline"):
            tier.get("v1/x")
    took = timed(get)
    assert 0.8 < took < 1.0, took  # the margin: the caller still reads why before its deadline
    tier.inner.get = real  # type: ignore[method-assign]
    assert tier.get("v1/absent") is None  # the breaker stayed closed: no "not tried"


def test_a_batch_ends_by_the_request_deadline(tmp_path: Path) -> None:
    tier, _ = hung_tier(tmp_path)

    def get_many() -> None:
        with request_deadline(time.monotonic() + 0.5), pytest.raises(StoreDeadline):
            tier.get_many(["v1/a", "v1/b"])
    assert timed(get_many) < 0.6


def test_a_passed_deadline_calls_nothing(tmp_path: Path) -> None:
    tier, _ = hung_tier(tmp_path)

    def get() -> None:
        with request_deadline(time.monotonic() - 1), pytest.raises(StoreDeadline):
            tier.get("v1/x")
    assert timed(get) < 0.05


def test_a_longer_request_deadline_keeps_call_s_and_the_breaker(tmp_path: Path) -> None:
    tier, _ = hung_tier(tmp_path, call_s=0.3)

    def get() -> None:
        with request_deadline(time.monotonic() + 60), pytest.raises(StoreUnavailable, match="within 0.3 s"):
            tier.get("v1/x")
    assert timed(get) < 0.5
    with pytest.raises(StoreUnavailable, match="not tried"):  # an outage: the next caller fails at once
        tier.get("v1/x")
