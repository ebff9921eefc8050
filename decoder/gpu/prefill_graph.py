"""Question prefills replayed as CUDA graphs: a hot context's next question costs a few graph
launches instead of ~1,200 kernel launches from Python.

A prefill of T tokens into slot row r after a context of n tokens is the same sequence of
kernels at the same addresses whatever the context's contents or the question's tokens: its
positions (n..n+T-1), attention spans and index columns are fixed by (r, n, T). So its layer
groups are captured once per (r, n, T), on that key's second use (a one-off question never
pays for a capture), and replayed after copying the new token ids into the graph's input. On
the H100 the eager prefill of a 20-token question on a 32K context took 27-37 ms of host time
for 12.7 ms of GPU time: host-bound, and on the engine thread it delays the decode steps it
joins. Capture only records (no kernel runs), so it may happen inside the admission it
serves, but one took 354 ms of host time on the H100 at 8 x 32K (sparse, a new memory pool
per graph beside nearly full HBM) and 82 ms with one pool: once a capture is slow, only an
admission alone on the runner captures, and the engine captures the keys seen once while it
has no stream (idle_work), so the streams decoding are never stalled by a capture.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
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
    graphs: list[torch.cuda.CUDAGraph] = field(default_factory=list)
    run: LayeredPrefill | None = None  # keeps the tensors the graphs read and write alive
    logits: torch.Tensor | None = None  # [1, V] the last graph's output


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

    def chunks(self, key: Key, ids: torch.Tensor, per_chunk: int, n_layers: int,
               make: Callable[[torch.Tensor], LayeredPrefill], may_capture: bool) -> Iterator[torch.Tensor | None] | None:
        """-> the key's graphs as chunk results (None, ..., logits [1, V]) with `ids` as input,
        capturing them (`make(input)` builds the prefill to record) on the key's second use
        where `may_capture`; None: run this prefill eagerly."""
        if self.broken or ids.device.type != "cuda":
            return None
        cap = self._seen.get(key)
        if cap is None:
            thread = threading.get_ident()
            if (key not in self._seen or thread not in self._eager_threads
                    or not (may_capture or self.capture_seconds < FAST_CAPTURE_S)):
                # a thread's first prefill creates its cuBLAS handles, which a capture cannot
                self._eager_threads.add(thread)
                self._remember(key, None)
                return None
            cap = self._capture(key, ids, per_chunk, n_layers, make)
            if cap is None:
                return None
        self._seen.move_to_end(key)
        return self._replay(cap, ids)

    def capture_seen(self, make_for: Callable[[Key], Callable[[torch.Tensor], LayeredPrefill]],
                     per_chunk_for: Callable[[int], int], n_layers: int, device: torch.device) -> bool:
        """Capture the most recent key seen once (idle time: the runner has no stream); ->
        whether one was captured."""
        if self.broken or device.type != "cuda" or threading.get_ident() not in self._eager_threads:
            return False
        key = next((k for k in reversed(self._seen) if self._seen[k] is None), None)
        if key is None:
            return False
        ids = torch.zeros(1, key[2], dtype=torch.long, device=device)  # a capture reads no values
        return self._capture(key, ids, per_chunk_for(key[2]), n_layers, make_for(key)) is not None

    @staticmethod
    def _replay(cap: _Captured, ids: torch.Tensor) -> Iterator[torch.Tensor | None]:
        """One prefill's graphs in order; the pool is shared, so the logits leave it as a copy
        before any other key's graph runs (one admission's chunks run back to back)."""
        cap.ids.copy_(ids, non_blocking=True)
        for i, graph in enumerate(cap.graphs):
            graph.replay()
            yield cap.logits.clone() if i == len(cap.graphs) - 1 else None

    def _capture(self, key: Key, ids: torch.Tensor, per_chunk: int, n_layers: int,
                 make: Callable[[torch.Tensor], LayeredPrefill]) -> _Captured | None:
        """Record every layer group (nothing runs); None, and eager from now on, if it fails."""
        t0 = time.perf_counter()
        cap = _Captured(torch.empty_like(ids))
        self._pool = self._pool or torch.cuda.graph_pool_handle()
        side = self._side = self._side or torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(side):
                for _ in range(-(-n_layers // per_chunk)):
                    graph = torch.cuda.CUDAGraph()
                    # thread-local: a build on another thread may use the GPU meanwhile
                    graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                    try:
                        if cap.run is None:
                            cap.run = make(cap.ids)
                        cap.logits = cap.run.run(per_chunk)
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
