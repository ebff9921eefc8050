"""BuildTurns on its own: one build computes at a time; a newcomer takes the turn from a build
that has had more time at its next check point; a cancelled waiter stops waiting."""

from __future__ import annotations

import threading
import time

from ctxcache.indexer.build_turns import BuildTurns


def _run(turns: BuildTurns, log: list, name: str, steps: int, step_s: float,
         started: threading.Event | None = None, cancelled=lambda: False) -> None:
    with turns.turn(cancelled) as checkpoint:
        for _ in range(steps):
            checkpoint()
            if started is not None:
                started.set()
            log.append(name)
            time.sleep(step_s)


def test_a_newcomer_runs_before_a_long_build_finishes():
    turns, log, started = BuildTurns(slice_s=0.02), [], threading.Event()
    heavy = threading.Thread(target=_run, args=(turns, log, "heavy", 100, 0.01, started))
    heavy.start()
    started.wait(5)
    time.sleep(0.1)  # the heavy build has had more than a slice
    light = threading.Thread(target=_run, args=(turns, log, "light", 5, 0.01))
    light.start()
    light.join(5)
    assert log.count("light") == 5 and log.count("heavy") < 50  # light finished while heavy was mid-way
    first = log.index("light")
    assert log[first:first + 5] == ["light"] * 5  # and ran without interruption (less time than heavy)
    heavy.join(10)
    assert log.count("heavy") == 100


def test_one_build_at_a_time():
    turns, inside, most = BuildTurns(slice_s=0.001), [0], [0]
    lock = threading.Lock()

    def build() -> None:
        with turns.turn() as checkpoint:
            for _ in range(20):
                checkpoint()
                with lock:
                    inside[0] += 1
                    most[0] = max(most[0], inside[0])
                time.sleep(0.001)
                with lock:
                    inside[0] -= 1

    threads = [threading.Thread(target=build) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert most[0] == 1


def test_a_cancelled_waiter_stops_waiting():
    turns, log, started, stop = BuildTurns(), [], threading.Event(), threading.Event()
    holder = threading.Thread(target=_run, args=(turns, log, "holder", 300, 0.01, started))
    holder.start()
    started.wait(5)
    t0 = time.perf_counter()
    threading.Timer(0.1, stop.set).start()
    with turns.turn(stop.is_set):  # returns once cancelled, without the turn
        took = time.perf_counter() - t0
    assert took < 1.0 and log.count("holder") < 300
    holder.join(10)
