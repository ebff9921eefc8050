"""The scheduler imports no torch and rotates live streams so none starves past max_batch; its
placement puts a stream's context in a resident slot while one is free, else a host slot, and
promotes a context held in a host slot by its next stream when it is used more lately."""

import subprocess
import sys

import pytest

from ctxcache.decoder.scheduler import OFFLOADED, RESIDENT, HeldSlot, Placement, Scheduler, StopRule


def test_rotation_retire_and_admit_twice():
    s = Scheduler(max_batch=2)
    for name in "abc":
        s.admit(name)
    assert s.next_batch() == ["a", "b"]
    assert s.next_batch() == ["c", "a"]  # the one left out goes first
    s.retire(["a"])
    assert sorted(s.live()) == ["b", "c"]
    with pytest.raises(ValueError, match="twice"):
        s.admit("b")
    with pytest.raises(ValueError, match="max_batch"):
        Scheduler(0)


def test_stop_rule():
    rule = StopRule(max_tokens=3, stop_token_ids=frozenset({7}))
    assert rule.done(7, 1, False) and rule.done(1, 3, False) and rule.done(1, 1, True)
    assert not rule.done(1, 2, False)


def test_scheduler_imports_no_torch():
    # load the module file alone (the ctxcache.decoder package itself pulls in torch)
    import ctxcache.decoder.scheduler as mod
    code = ("import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('sched', {mod.__file__!r})\n"
            "m = importlib.util.module_from_spec(spec); sys.modules['sched'] = m; spec.loader.exec_module(m)\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_placement_is_resident_while_a_resident_slot_is_free_else_offloaded():
    p = Placement(clock=Clock())
    empty, host = HeldSlot(None, False), [HeldSlot(None, False)]
    assert p.choose("x", [HeldSlot("a", True), empty], host) == RESIDENT
    busy = [HeldSlot("a", True), HeldSlot("b", True)]
    assert p.choose("x", busy, host) == OFFLOADED  # every resident slot streams: not waiting
    assert p.choose("a", busy, host) == OFFLOADED  # its own slot streams too: a second copy
    assert p.choose("x", busy, [HeldSlot("y", True)]) == RESIDENT  # every host slot busy too: wait for HBM
    assert p.choose("x", [HeldSlot("a", False)], host) == RESIDENT  # a cold context loads into HBM
    assert p.choose("a", [HeldSlot("b", False, 1.0), HeldSlot("a", False, 0.0)], []) == RESIDENT  # hot in HBM


def test_an_offloaded_context_is_promoted_by_its_next_stream_when_used_more_lately():
    """x is held in a host slot, a resident slot is idle: x's next stream takes it only if x was
    used more lately than the context that slot would push out (the least recently used idle
    one); the uses decay with USE_HALF_LIFE_S."""
    clock = Clock()
    p = Placement(half_life_s=60.0, clock=clock)
    host = [HeldSlot("x", False), HeldSlot("y", True)]
    resident = [HeldSlot("a", False, last_used=5.0), HeldSlot("b", False, last_used=2.0)]  # b goes first
    for cid in ("a", "b", "b", "x"):
        p.used(cid)
    assert p.choose("x", resident, host) == OFFLOADED  # x 1 use, b 2: x stays in its host slot
    p.used("x")
    assert p.choose("x", resident, host) == OFFLOADED  # level: no churn
    p.used("x")
    assert p.choose("x", resident, host) == RESIDENT  # 3 against 2: promoted
    clock.now += 120.0  # two half-lives: x's 3 uses weigh 0.75
    p.used("b")  # b: 0.5 + 1
    assert p.score("b") == 1.5 and p.score("x") == 0.75
    assert p.choose("x", resident, host) == OFFLOADED
    assert p.choose("x", [HeldSlot(None, False)], host) == RESIDENT  # an empty resident slot: promoted
    with pytest.raises(ValueError, match="half_life_s=0"):
        Placement(half_life_s=0)
