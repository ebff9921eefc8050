"""Device durations of the runner's own work (its decode steps), measured by CUDA event pairs
and read only once they have completed: measuring never waits for the device. The engine times
its next launch by them, so a joiner's prefill chunk can still go before that step."""

from __future__ import annotations

from collections import deque

import torch

# weight of the newest measurement: a few steps follow a change of batch size
EMA_WEIGHT = 0.3


class DeviceTimes:
    def __init__(self, device: torch.device) -> None:
        self.on = device.type == "cuda"
        self._pending: deque[tuple[str, torch.cuda.Event, torch.cuda.Event, int]] = deque()
        self._ms: dict[str, float] = {}

    def start(self) -> torch.cuda.Event | None:
        """An event recorded now on the current stream (None off CUDA)."""
        if not self.on:
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def stop(self, kind: str, started: torch.cuda.Event | None, units: int = 1) -> None:
        """The work queued since `started` is `units` of `kind` (its time read once it has run)."""
        if started is None:
            return
        ended = torch.cuda.Event(enable_timing=True)
        ended.record()
        self._pending.append((kind, started, ended, units))
        if len(self._pending) > 8:  # read as they land, whether or not anyone asks
            self._harvest()

    def ms(self, kind: str) -> float | None:
        """Milliseconds of one unit of `kind` (a moving average), None before one has completed."""
        self._harvest()
        return self._ms.get(kind)

    def _harvest(self) -> None:
        # one stream: the pairs complete in the order they were queued
        while self._pending and self._pending[0][2].query():
            kind_done, started, ended, units = self._pending.popleft()
            got = started.elapsed_time(ended) / units
            old = self._ms.get(kind_done)
            self._ms[kind_done] = got if old is None else old + EMA_WEIGHT * (got - old)
