"""The scheduler imports no torch and rotates live streams so none starves past max_batch."""

import subprocess
import sys

import pytest

from ctxcache.decoder.scheduler import Scheduler, StopRule


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
