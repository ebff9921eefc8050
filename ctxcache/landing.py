"""Which layers of an artifact still arriving from the object store have landed (no torch).

Why: a cold load from the object store took the whole download (0.45-0.54 s at 32K on an H200)
before the first layer was copied into a GPU slot, then the slot load and the question's prefill
on top. With a Landing the store hands the artifact over once its manifest is read and its host
memory laid out, and decodes each chunk into it as it arrives; a slot load copies layer i as soon
as `wait(i)` returns (every chunk of layer i, and the context-wide ones, read, checked against the
manifest and decoded), while later layers are still arriving.

Guarantees kept: a layer is never handed over before its chunks passed their checks, and a
damaged or missing chunk anywhere fails the landing: every later `wait` raises that error
(CorruptArtifact: DATA_LOSS), and a slot load ends with `wait()` (everything, the chunks it does
not decode included), so a damaged chunk still answers before any token.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

CONTEXT = -1  # the context-wide chunks' layer (tokens, last_logits): every layer waits for them


class Landing:
    """layers: the layer of each chunk that is decoded into the artifact (None: context-wide),
    in the order `landed(i)` names them; n_layers: the artifact's layer count."""

    def __init__(self, layers: Sequence[int | None], n_layers: int) -> None:
        if n_layers < 0 or any(la is not None and not 0 <= la < n_layers for la in layers):
            raise ValueError(f"chunk layers {sorted({la for la in layers if la is not None})} must lie in "
                             f"[0, n_layers={n_layers})")
        self._layer_of = [CONTEXT if la is None else la for la in layers]
        self._left = [0] * (n_layers + 1)  # index CONTEXT (-1) is the last entry
        for la in self._layer_of:
            self._left[la] += 1
        self._cond = threading.Condition()
        self._started = time.perf_counter()
        self.seconds: float | None = None  # from the hand-over to the download's good end
        self._finished = False
        self._error: BaseException | None = None  # what waits raise (set after the callbacks ran)
        self._failing: BaseException | None = None
        self._on_fail: list[Callable[[BaseException], None]] = []

    def landed(self, i: int) -> None:
        """Chunk i is checked and decoded into the artifact."""
        with self._cond:
            self._left[self._layer_of[i]] -= 1
            self._cond.notify_all()

    def finish(self) -> None:
        """The download ended well: every chunk (those not decoded too) was read and checked."""
        with self._cond:
            self._finished = True
            self.seconds = time.perf_counter() - self._started
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """The download failed: the callbacks run (once), then every wait not yet answered
        raises `error`. Why in that order: a caller that raises DATA_LOSS from a wait must find
        the context already dropped (from DRAM) and marked damaged."""
        with self._cond:
            if self._failing is not None or self._finished:
                return
            self._failing = error  # from here on_fail calls at once
            calls = list(self._on_fail)
        try:
            for call in calls:
                call(error)
        finally:
            with self._cond:
                self._error = error
                self._cond.notify_all()

    def on_fail(self, call: Callable[[BaseException], None]) -> None:
        """call(error) if the download fails (at once if it is failing already)."""
        with self._cond:
            error = self._failing
            if error is None:
                self._on_fail.append(call)
        if error is not None:
            call(error)

    def ready(self, layer: int | None = None) -> bool:
        """Whether wait(layer) would return now without raising."""
        with self._cond:
            return self._error is None and self._done(layer)

    def wait(self, layer: int | None = None, timeout: float | None = None) -> None:
        """Until layer `layer`'s chunks and the context-wide ones have landed (None: until the
        whole download has ended well); raises the download's error if it failed first (a
        layer that landed before a later one failed is still answered), TimeoutError after
        `timeout` seconds."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._done(layer) or self._error is not None, timeout):
                raise TimeoutError(f"layer {layer} did not land within {timeout} s")
            if self._error is not None and not (layer is not None and self._done(layer)):
                raise self._error

    def _done(self, layer: int | None) -> bool:
        if layer is None:
            return self._finished
        return self._finished or (self._left[CONTEXT] == 0 and self._left[layer] == 0)

    @property
    def failed(self) -> BaseException | None:
        with self._cond:
            return self._error


def wait_landed(art: object) -> None:
    """Until an artifact handed over while landing (its `landing`) has landed whole; at once
    for any other."""
    landing = getattr(art, "landing", None)
    if landing is not None:
        landing.wait()
