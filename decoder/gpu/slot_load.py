"""A context's K/V copied into a slot on a side stream, a layer at a time.

The K/V codes (the bulk of a load: 2.1 GB at 32K tokens of Llama-3.1-8B shapes) are decoded
from pinned host memory straight into the cache on a side stream (kv_codec.decode_into: one
kernel per tensor, PCIe-bound), an event after each layer; the compute stream derives that
layer's index rows as soon as its event fires, so the rows of layer i overlap the copy of
layers i+1... The side stream starts after the work already queued on the compute stream (an
idle row of the step in flight still writes a throw-away key into this slot) and the compute
stream waits for all of it before anything later (no step sees a half-loaded slot). The
artifact is held until its copies are done: they read its host memory in place, and its host
pool range is reused once the last tensor viewing it is gone.
"""

from __future__ import annotations

import torch

from ctxcache.artifact import ContextArtifact
from ctxcache.models.kv_cache import KVCache


class SlotLoader:
    def __init__(self, device: torch.device) -> None:
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._held: list[tuple[torch.cuda.Event, ContextArtifact]] = []

    def copy_kv(self, cache: KVCache, row: int, art: ContextArtifact) -> list[torch.cuda.Event | None]:
        """Queue every layer's K/V into cache row `row`; -> an event per layer (None on a CPU,
        where the copies are done on return)."""
        n = art.n_tokens
        self._held = [(ev, a) for ev, a in self._held if not ev.query()]
        if self.side is None:
            for layer, la in enumerate(art.layers):
                la.kv_into(cache.k[layer][row, :, :n], cache.v[layer][row, :, :n])
            return [None] * len(art.layers)
        self.side.wait_stream(torch.cuda.current_stream())
        events = []
        with torch.cuda.stream(self.side):
            for layer, la in enumerate(art.layers):
                la.kv_into(cache.k[layer][row, :, :n], cache.v[layer][row, :, :n])
                events.append(torch.cuda.Event())
                events[-1].record(self.side)
        return events

    @staticmethod
    def wait(event: torch.cuda.Event | None) -> None:
        """The compute stream's later work waits for this layer's K/V."""
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def finish(self, art: ContextArtifact) -> None:
        """The compute stream waits for every copy; the artifact is held until they are done."""
        if self.side is None:
            return
        torch.cuda.current_stream().wait_stream(self.side)
        done = torch.cuda.Event()
        done.record(self.side)
        self._held.append((done, art))
