"""Which streams step next: admission, round-robin over live streams, retirement.

No torch here (nano-vllm keeps its scheduler free of the device the same way), so the policy is
testable in milliseconds. A stream is an opaque handle; the engine tells the scheduler when a
stream joins, produced a token, or was cancelled, and asks it for the next batch.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
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
