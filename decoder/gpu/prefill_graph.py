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
it delays the decode steps it joins. A capture costs that host time too (one pool for every
graph: 82 ms at 8 x 32K, 354 ms with a pool per graph), so the admission that captures records
each layer's graph just before replaying it, a group of layers beside each decode step as an
eager prefill runs (Capturing). On the H100 at 32K (bench serve), capturing all 32 layers at
once: sparse hot TTFT p50 / p99 34 / 158 ms (a 153 ms one had the capture in its profile), dense
joiner p99 beside 7 decoding 80 ms, the seven's ITL p99 2.32x their median; captured as they
run: 24 / 76 ms, 36 ms, 1.69x. The engine also captures the keys seen once while it has no
stream (idle_work).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ctxcache.generation import LayeredPrefill

_log = logging.getLogger(__name__)
Key = tuple[int, ...]  # (slot row, context length, padded prompt tokens, then whatever else fixes the kernels)


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
        self._eager_threads: set[int] = set()  # threads that ran an eager prefill
        self._side: torch.cuda.Stream | None = None  # the capture stream (one: its cuBLAS workspace once)
        # one memory pool for every prefill graph (replayed one prefill at a time, as the decode
        # graphs share theirs): later captures reuse its blocks instead of new device memory
        self._pool: tuple | None = None

    def prefill(self, key: Key, ids: torch.Tensor, n_layers: int, make: Callable[[torch.Tensor], LayeredPrefill],
                first_use: bool = False) -> "Replay | Capturing | None":
        """-> the key's graphs replaying a prefill with `ids` as input, or capturing them as it
        runs (`make(input)` builds the prefill to record) on the key's second use (or its
        first, with `first_use`); None: run this prefill eagerly."""
        if self.broken or ids.device.type != "cuda":
            return None
        cap = self._seen.get(key)
        if cap is None:
            thread = threading.get_ident()
            if not (first_use or key in self._seen) or thread not in self._eager_threads:
                # a thread's first prefill creates its cuBLAS handles, which a capture cannot
                self._eager_threads.add(thread)
                self.remember(key, None)
                return None
            return Capturing(self, key, ids, n_layers, make)
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
        cap = _Captured(torch.zeros(1, key[2] + 1, dtype=torch.long, device=device))
        if not self.record(key, cap, n_layers, make_for(key)):
            return False
        self.remember(key, cap)
        return True

    def record(self, key: Key, cap: _Captured, layers: int, make: Callable[[torch.Tensor], LayeredPrefill]) -> bool:
        """Record the next `layers` layers' graphs into cap (nothing runs); False, and eager
        from now on, if that fails."""
        self._pool = self._pool or torch.cuda.graph_pool_handle()
        side = self._side = self._side or torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(side):
                for _ in range(layers):
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
            return False
        finally:
            torch.cuda.current_stream().wait_stream(side)
        return True

    def remember(self, key: Key, cap: _Captured | None) -> None:
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


class Capturing:
    """A key's prefill that records each group of layers' graphs, then replays them, as
    LayeredPrefill.run runs a group: the capture's host time is spread over the decode steps the
    admission joins. Once the last layer ran, the key's later prompts replay its graphs. If a
    capture fails, this prefill runs eagerly from its first layer (rewriting what the replayed
    layers wrote: the same positions and index columns)."""

    def __init__(self, graphs: PrefillGraphs, key: Key, ids: torch.Tensor, n_layers: int,
                 make: Callable[[torch.Tensor], LayeredPrefill]) -> None:
        self.graphs, self.key, self.n_layers, self.make = graphs, key, n_layers, make
        self.cap = _Captured(ids.clone())
        self.layer = 0
        self._eager: LayeredPrefill | None = None

    def run(self, layers: int) -> torch.Tensor | None:
        """Capture and replay up to `layers` more layers: -> the last token's logits [1, V]
        after the last."""
        if self._eager is None:
            end = min(self.layer + max(1, layers), self.n_layers)
            if self.graphs.record(self.key, self.cap, end - self.layer, self.make):
                for graph in self.cap.graphs[self.layer:end]:
                    graph.replay()
                self.layer = end
                if end < self.n_layers:
                    return None
                self.graphs.remember(self.key, self.cap)
                return self.cap.logits.clone()
            self._eager = self.make(self.cap.ids)
        logits = self._eager.run(layers)
        self.layer = self._eager.layer
        return logits
