"""A stream's admission handed from its caller's thread to the engine thread.

The caller claims a slot and loads the context (runner.begin); the engine thread runs the
question's prefill a chunk per decode step, between launches, so admissions never hold the
device buffers for a whole prefill while streams decode. Either side may end it first: the
caller stops waiting (cancelled, past its deadline) or the engine finishes or fails it. Whoever
comes second owns the row's release, decided under one lock, so a row is released once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ctxcache.decoder.inflight import HostLogits


class Admission:
    def __init__(self, row: Any, chunks: Iterator[torch.Tensor | None], release: Callable[[Any], None]) -> None:
        self.row, self.chunks, self._release = row, chunks, release
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._first: HostLogits | None = None
        self._error: BaseException | None = None
        self.abandoned = False

    def advance(self) -> bool:
        """Run one chunk (engine thread): -> whether the admission is over."""
        if self.abandoned:
            self.chunks.close()
            self._release(self.row)
            return True
        try:
            first = next(self.chunks)
        except BaseException as exc:  # noqa: BLE001 - raised in the caller; the runner forgot the row
            self._end(None, exc)
            return True
        if first is None:
            return False
        if not self._end(HostLogits.start(first), None):
            self._release(self.row)  # the caller left while the last chunk ran
        return True

    def fail(self, error: BaseException) -> None:
        """The engine stopped before finishing it: the row is released, the caller raises."""
        self.chunks.close()
        self._release(self.row)
        self._end(None, error)

    def _end(self, first: HostLogits | None, error: BaseException | None) -> bool:
        """-> False when the caller had abandoned it."""
        with self._lock:
            self._first, self._error = first, error
            self._done.set()
            return not self.abandoned

    def wait(self, check: Callable[[], None], poll_s: float = 0.05) -> torch.Tensor:
        """The first logits (caller thread; the caller then owns the row), running `check`
        while waiting: if it raises before the prefill ends, the engine releases the row."""
        while not self._done.wait(poll_s):
            try:
                check()
            except BaseException:
                with self._lock:
                    if not self._done.is_set():
                        self.abandoned = True
                        raise
                break  # it ended meanwhile: its result stands (a later check stops the stream)
        if self._error is not None:
            raise self._error
        return self._first.result()
