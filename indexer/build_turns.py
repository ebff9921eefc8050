"""Builds take turns: one computes at a time, and a heavy build yields to other tenants' builds.

Builds run on their own threads (BuildQueue's lanes), but only the one holding the turn
computes; the others wait at a check point of their build (ctxcache/cancel.py: every
transformer block, method layer and k-means iteration). At a check point the holder hands
the turn over when it has held it for `slice_s` and a waiting build has had less build time
than it has (least attained service: a new build starts at 0, so a default build that arrives
while a heavy one runs goes first and finishes in about its own time). Why not a plain FIFO: a
PutContext with allowed but maximal parameters took minutes, and every other tenant's build
waited behind it. No torch here: a scheduling unit, testable in milliseconds.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(eq=False)
class _Build:
    order: int
    attained: float = 0.0  # seconds it has held the turn
    since: float | None = None  # when its current turn began; None: not holding it


class BuildTurns:
    def __init__(self, slice_s: float = 0.25, clock: Callable[[], float] = time.monotonic,
                 poll_s: float = 0.1) -> None:
        self.slice_s, self._clock, self._poll_s = slice_s, clock, poll_s
        self._cond = threading.Condition()
        self._builds: list[_Build] = []  # started, not finished
        self._holder: _Build | None = None
        self._order = itertools.count()

    @contextmanager
    def turn(self, cancelled: Callable[[], bool] = lambda: False) -> Iterator[Callable[[], None]]:
        """Hold the turn for a build; -> its check-point callable (CancelToken.on_check).
        cancelled: a waiting build stops waiting once it is (it then raises at its check)."""
        b = _Build(next(self._order))
        with self._cond:
            self._builds.append(b)
            self._acquire(b, cancelled)
        try:
            yield lambda: self._checkpoint(b, cancelled)
        finally:
            with self._cond:
                self._release(b)
                self._builds.remove(b)

    def waiting(self) -> int:
        with self._cond:
            return sum(b.since is None for b in self._builds)

    def _next(self) -> _Build | None:
        waiting = [b for b in self._builds if b.since is None]
        return min(waiting, key=lambda b: (b.attained, b.order), default=None)

    def _acquire(self, b: _Build, cancelled: Callable[[], bool]) -> None:
        while not (self._holder is None and self._next() is b):
            if cancelled():
                return
            self._cond.wait(self._poll_s)
        self._holder, b.since = b, self._clock()

    def _release(self, b: _Build) -> None:
        if self._holder is b:
            b.attained += self._clock() - b.since
            self._holder, b.since = None, None
            self._cond.notify_all()

    def _checkpoint(self, b: _Build, cancelled: Callable[[], bool]) -> None:
        if len(self._builds) < 2:  # fast path: alone (a stale read only delays the hand-over)
            return
        with self._cond:
            if self._holder is not b:  # it stopped waiting when cancelled: take the turn now
                self._acquire(b, cancelled)
                return
            held = self._clock() - b.since
            other = self._next()
            if held < self.slice_s or other is None or other.attained >= b.attained + held:
                return
            self._release(b)
            self._acquire(b, cancelled)
