"""Question prefills replayed as CUDA graphs: a hot context's next question costs a few graph
launches instead of ~1,300 kernel launches from Python.

A prefill of T tokens (a prompt padded to slot_prefill.PAD_TO) into slot row r after a context
of n tokens is the same sequence of kernels at the same addresses whatever the context's
contents, the question's tokens or its real length (a device input): its positions, attention
spans and index columns are fixed by (r, n, T). So its layers are captured once per (r, n, T),
a graph each (the engine replays as many per decode step as the step's time allows), on that
key's second use (a one-off question never pays for a capture) or on its first where the
admission loaded the slot (its stream waits for that load anyway), and replayed after copying
the new input into the graph's. On the H100 the eager prefill of a 20-token question on a 32K
context took ~40 ms of host time for 12-17 ms of GPU time: host-bound, and on the engine thread
it delays the decode steps it joins. Capture only records (no kernel runs), so it may happen
inside the admission it serves, but one took 354 ms of host time on the H100 at 8 x 32K
(sparse, a new memory pool per graph beside nearly full HBM) and 82 ms with one pool: once a
capture is slow, only an admission alone on the runner or one that loaded its slot captures,
and the engine captures the keys seen once while it has no stream (idle_work).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ctxcache.generation import LayeredPrefill

_log = logging.getLogger(__name__)
# captures this fast may run while other streams decode (a step's worth of host time); once
# one took longer, only an admission alone on the runner captures
FAST_CAPTURE_S = 0.02
Key = tuple[int, int, int]  # (slot row, context length, prompt tokens)


@dataclass(eq=False)
class _Captured:
    ids: torch.Tensor  # [1, T] the graphs' input
    graphs: list[torch.cuda.CUDAGraph] = field(default_factory=list)  # one per layer
    run: LayeredPrefill | None = None  # keeps the tensors the graphs read and write alive
    logits: torch.Tensor | None = None  # [1, V] the last layer's graph's output


class PrefillGraphs:
    """Per key: None the first time (run it eagerly), then a capture, then replays; LRU over
    at most `keep` keys (each holds its graphs' private memory, a few MB at 8B shapes)."""

    def __init__(self, keep: int = 32) -> None:
        self.keep = keep
        self._seen: OrderedDict[Key, _Captured | None] = OrderedDict()
        self.broken = False  # a capture failed once: eager from then on (logged)
        self.capture_seconds = 0.0  # the slowest capture (host time)
        self._eager_threads: set[int] = set()  # threads that ran an eager prefill
        self._side: torch.cuda.Stream | None = None  # the capture stream (one: its cuBLAS workspace once)
        # one memory pool for every prefill graph (replayed one prefill at a time, as the decode
        # graphs share theirs): later captures reuse its blocks instead of new device memory
        self._pool: tuple | None = None

    def prefill(self, key: Key, ids: torch.Tensor, n_layers: int, make: Callable[[torch.Tensor], LayeredPrefill],
                may_capture: bool, first_use: bool = False) -> "Replay | None":
        """-> the key's graphs replaying a prefill with `ids` as input, capturing them
        (`make(input)` builds the prefill to record) on the key's second use (or its first,
        with `first_use`) where `may_capture`; None: run this prefill eagerly."""
        if self.broken or ids.device.type != "cuda":
            return None
        cap = self._seen.get(key)
        if cap is None:
            thread = threading.get_ident()
            if (not (first_use or key in self._seen) or thread not in self._eager_threads
                    or not (may_capture or self.capture_seconds < FAST_CAPTURE_S)):
                # a thread's first prefill creates its cuBLAS handles, which a capture cannot
                self._eager_threads.add(thread)
                self._remember(key, None)
                return None
            cap = self._capture(key, ids, n_layers, make)
            if cap is None:
                return None
        self._seen.move_to_end(key)
        return Replay(cap, ids)

    def capture_seen(self, make_for: Callable[[Key], Callable[[torch.Tensor], LayeredPrefill]], n_layers: int,
                     device: torch.device) -> bool:
        """Capture the most recent key seen once (idle time: the runner has no stream); ->
        whether one was captured."""
        if self.broken or device.type != "cuda" or threading.get_ident() not in self._eager_threads:
            return False
        key = next((k for k in reversed(self._seen) if self._seen[k] is None), None)
        if key is None:
            return False
        # the padded prompt and its real length (slot_prefill.prompt_input); a capture reads no values
        ids = torch.zeros(1, key[2] + 1, dtype=torch.long, device=device)
        return self._capture(key, ids, n_layers, make_for(key)) is not None

    def _capture(self, key: Key, ids: torch.Tensor, n_layers: int,
                 make: Callable[[torch.Tensor], LayeredPrefill]) -> _Captured | None:
        """Record a graph per layer (nothing runs); None, and eager from now on, if it fails."""
        t0 = time.perf_counter()
        cap = _Captured(torch.empty_like(ids))
        self._pool = self._pool or torch.cuda.graph_pool_handle()
        side = self._side = self._side or torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(side):
                for _ in range(n_layers):
                    graph = torch.cuda.CUDAGraph()
                    # thread-local: a build on another thread may use the GPU meanwhile
                    graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                    try:
                        if cap.run is None:
                            cap.run = make(cap.ids)
                        cap.logits = cap.run.run(1)
                    finally:
                        graph.capture_end()
                    cap.graphs.append(graph)
        except Exception:  # noqa: BLE001 - eager prefills still serve; the log says why
            self.broken = True
            self._seen.pop(key, None)  # (and capture_seen never picks it again)
            _log.exception("capturing a prefill graph failed: question prefills run eagerly from now on")
            return None
        finally:
            torch.cuda.current_stream().wait_stream(side)
        self.capture_seconds = max(self.capture_seconds, time.perf_counter() - t0)
        self._remember(key, cap)
        return cap

    def _remember(self, key: Key, cap: _Captured | None) -> None:
        self._seen[key] = cap
        self._seen.move_to_end(key)
        while len(self._seen) > self.keep:
            self._seen.popitem(last=False)


class Replay:
    """A captured prefill replayed a group of layers at a time, as LayeredPrefill.run runs one.
    The pool is shared, so the logits leave it as a copy before any other key's graph runs
    (the engine runs one admission's chunks to its end before the next admission's)."""

    def __init__(self, cap: _Captured, ids: torch.Tensor) -> None:
        cap.ids.copy_(ids, non_blocking=True)
        self.cap, self.layer = cap, 0

    def run(self, layers: int) -> torch.Tensor | None:
        """Replay up to `layers` more layers: -> the last token's logits [1, V] after the last."""
        graphs = self.cap.graphs
        end = min(self.layer + max(1, layers), len(graphs))
        for graph in graphs[self.layer:end]:
            graph.replay()
        self.layer = end
        return self.cap.logits.clone() if end == len(graphs) else None
