"""Which streams step next: admission, round-robin over live streams, retirement; and where a
stream's context is held (Placement: a resident HBM slot or a host slot, serve --offload).

No torch here (nano-vllm keeps its scheduler free of the device the same way), so the policy is
testable in milliseconds. A stream is an opaque handle; the engine tells the scheduler when a
stream joins, produced a token, or was cancelled, and asks it for the next batch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class StopRule:
    """When a stream ends: a stop token (emitted), max_tokens produced, or a full cache."""

    max_tokens: int
    stop_token_ids: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")

    def done(self, token: int, produced: int, cache_full: bool) -> bool:
        return token in self.stop_token_ids or produced >= self.max_tokens or cache_full


class Scheduler:
    """Live streams in arrival order; each step takes at most max_batch of them, and those
    beyond max_batch move to the front of the next step (oldest first, none starves)."""

    def __init__(self, max_batch: int) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch} must be >= 1")
        self.max_batch = max_batch
        self._live: list[Hashable] = []

    def __len__(self) -> int:
        return len(self._live)

    def live(self) -> list[Hashable]:
        return list(self._live)

    def admit(self, stream: Hashable) -> None:
        if stream in self._live:
            raise ValueError("stream admitted twice")
        self._live.append(stream)

    def retire(self, streams: Iterable[Hashable]) -> None:
        gone = set(streams)
        self._live = [s for s in self._live if s not in gone]

    def next_batch(self) -> list[Hashable]:
        """The streams of the next step (empty when none is live)."""
        batch = self._live[:self.max_batch]
        self._live = self._live[self.max_batch:] + batch
        return batch


RESIDENT, OFFLOADED = "resident", "offloaded"
USE_HALF_LIFE_S = 120.0  # a stream start weighs half as much this long after it
USES_KEPT = 4096  # contexts whose use is remembered (the least used beyond are forgotten)


@dataclass(frozen=True)
class HeldSlot:
    """A runner slot as placement sees it: the context it holds (None: empty), whether a stream
    decodes in it, and when its last stream ended."""

    context_id: str | None
    busy: bool
    last_used: float = 0.0


def claimed(slots: list[HeldSlot], context_id: str) -> HeldSlot | None:
    """The slot a runner claims for the context (GpuRunner._claim): its idle slot, else an empty
    one, else the least recently used idle one; None when every slot is busy."""
    idle = [s for s in slots if not s.busy]
    return (next((s for s in idle if s.context_id == context_id), None)
            or next((s for s in idle if s.context_id is None), None)
            or min(idle, key=lambda s: s.last_used, default=None))


class Placement:
    """Where a stream's context is held when it fits both a resident (HBM) slot and a host slot
    (serve --offload). Resident while a resident slot is free; with every resident slot busy,
    offloaded in a host slot instead of waiting (with every host slot busy too, it waits for a
    resident slot). Only a new stream moves a context, so no stream stops mid-way: a context held
    in a host slot is promoted by its next stream when a resident slot is free and it was used
    more lately (a decayed count of stream starts) than the context that slot would push out;
    that context is demoted to the DRAM tier (its next stream is placed as any other)."""

    def __init__(self, half_life_s: float = USE_HALF_LIFE_S, clock: Callable[[], float] = time.monotonic) -> None:
        if half_life_s <= 0:
            raise ValueError(f"half_life_s={half_life_s} must be > 0")
        self.half_life_s, self.clock = half_life_s, clock
        self._uses: dict[str, tuple[float, float]] = {}  # context id -> (decayed count, at)
        self._lock = threading.Lock()  # streams start in many callers' threads

    def used(self, context_id: str) -> None:
        """A stream on the context starts."""
        with self._lock:
            now = self.clock()
            self._uses[context_id] = (self._score(context_id, now) + 1.0, now)
            if len(self._uses) > USES_KEPT:
                del self._uses[min(self._uses, key=lambda c: self._score(c, now))]

    def score(self, context_id: str | None) -> float:
        """The context's stream starts, each weighing 0.5 ** (its age / half_life_s)."""
        with self._lock:
            return self._score(context_id, self.clock())

    def _score(self, context_id: str | None, now: float) -> float:
        count, at = self._uses.get(context_id, (0.0, 0.0)) if context_id is not None else (0.0, 0.0)
        return count * 0.5 ** ((now - at) / self.half_life_s)

    def choose(self, context_id: str, resident: list[HeldSlot], host: list[HeldSlot]) -> str:
        """RESIDENT or OFFLOADED for a stream starting on the context."""
        victim = claimed(resident, context_id)
        if victim is None:
            return OFFLOADED if any(not s.busy for s in host) else RESIDENT
        if victim.context_id in (None, context_id):
            return RESIDENT
        if any(s.context_id == context_id and not s.busy for s in host):  # hot in a host slot
            return RESIDENT if self.score(context_id) > self.score(victim.context_id) else OFFLOADED
        return RESIDENT  # loaded either way: into HBM, where it decodes several times faster
