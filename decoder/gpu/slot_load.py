"""A context copied into a slot: its K/V codes cross PCIe by the copy engine, a layer at a time.

The K/V codes (the bulk of a load: 2.1 GB at 32K tokens of Llama-3.1-8B shapes) are copied from
pinned host memory into a ring of RING device staging buffers on a side stream (plain async
copies: the copy engine runs at the link's rate, 55 GB/s on an H200, and takes no SMs from the
decode steps); the compute stream decodes each layer from its staging buffer into the cache as
soon as it lands (kv_codec.decode_into, one kernel per tensor) and derives its index rows
(`per_layer`), while the next layers are still crossing. The side stream starts after the work
already queued on the compute stream (an idle row of the step in flight still writes a
throw-away key into this slot), reuses a staging buffer only after the compute stream has read
it, and the artifact is held until its copies are done (they read its host pool range in place).
An artifact still arriving from the object store (ctxcache/landing.py) is copied a layer at a
time as each layer lands, so its copies, decodes and the question's prefill overlap the download.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ctxcache.artifact import ContextArtifact
from ctxcache.kv_codec import CodedKV
from ctxcache.models.kv_cache import KVCache

RING = 3  # layers of codes in flight: one landing, one being decoded, one spare
# of a landing artifact's layers, those a slot load waits for under the runner's lock (the rest
# land before it is taken: land_ahead). Why: a download runs ~14 ms a layer at 32K on an H200
# (66 MB at ~4.7 GB/s) and a landed layer's copy, decode and prefill take a few ms, so the
# layers before these are on the GPU by the time the last one lands, while decoding streams
# wait for the lock only about as long as for a load from DRAM (~50 ms), not the download.
LOCKED_SHARE = 8  # 1/8 of the layers (4 of Llama-3.1-8B's 32)
POLL_S = 0.05  # how often land_ahead runs the caller's check (cancel, deadline)


class SlotLoader:
    def __init__(self, device: torch.device) -> None:
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._held: list[tuple[torch.cuda.Event, ContextArtifact]] = []
        self._ring: list[torch.Tensor] = []  # RING flat staging buffers, grown to the largest layer

    def load(self, cache: KVCache, row: int, art: ContextArtifact,
             per_layer: Callable[[int, dict[str, torch.Tensor]], None], tables: bool = True,
             then: Callable[[int], None] | None = None) -> None:
        """Every layer's K/V into cache row `row`, then `per_layer(layer, its tables on the
        device)` on the compute stream (its work ordered after that layer's K/V; the staged
        tables are read only there), then `then(layer)`; tables False: the tables stay on the
        host (an empty dict is passed). An artifact still landing (art.landing) is read a
        layer at a time as each lands, in this thread; its download's error is raised here."""
        then = then or (lambda layer: None)
        n, landing = art.n_tokens, getattr(art, "landing", None)
        wait = landing.wait if landing is not None else (lambda layer: None)
        if self.side is None:
            for layer, la in enumerate(art.layers):
                wait(layer)
                la.kv_into(cache.k[layer][row, :, :n], cache.v[layer][row, :, :n])
                per_layer(layer, dict(la.tables) if tables else {})
                then(layer)
            wait(None)
            return
        self._held = [(ev, a) for ev, a in self._held if not ev.query()]
        main = torch.cuda.current_stream()
        self.side.wait_stream(main)
        try:
            self._layers(cache, row, art, per_layer, tables, then, wait, main)
        finally:
            # held until every copy queued so far has read its host memory, also when a layer
            # fails to land mid-load (the copies of the layers before it are in flight); main
            # has waited for each side-stream copy, so its event covers both streams' copies
            done = torch.cuda.Event()
            done.record(main)
            self._held.append((done, art))
        # every chunk checked, the ones not copied too, before the caller samples a token: a
        # damaged one answers DATA_LOSS first (the caller forgets the slot)
        wait(None)

    def _layers(self, cache: KVCache, row: int, art: ContextArtifact,
                per_layer: Callable[[int, dict[str, torch.Tensor]], None], tables: bool,
                then: Callable[[int], None], wait: Callable[[int], None], main: torch.cuda.Stream) -> None:
        read: list[torch.cuda.Event | None] = [None] * RING  # the compute stream is done with slot r
        n = art.n_tokens
        for layer, la in enumerate(art.layers):
            wait(layer)  # a landing artifact's layer, read and checked on the host (ctxcache/landing.py)
            k_out, v_out = cache.k[layer][row, :, :n], cache.v[layer][row, :, :n]
            host_tables = la.tables if tables else {}
            if la.coded is None:  # decoded K/V (a CPU-built artifact): copied as they are
                la.kv_into(k_out, v_out)
                staged = {name: t.to(main.device, non_blocking=True) for name, t in host_tables.items()}
            else:
                parts = {**{f"kv.{k}": t for k, t in la.coded.parts.items()},
                         **{f"table.{k}": t for k, t in host_tables.items()}}
                views = self._stage(parts, layer % RING, read[layer % RING], main)
                coded = la.coded
                CodedKV(coded.codec, {k: views[f"kv.{k}"] for k in coded.parts}, coded.shape,
                        coded.dtype).decode_into(k_out, v_out)
                staged = {k: views[f"table.{k}"] for k in host_tables}
            per_layer(layer, staged)
            if la.coded is not None:  # the ring slot is free once this layer's work has read it
                read[layer % RING] = torch.cuda.Event()
                read[layer % RING].record(main)
            then(layer)

    def _stage(self, parts: dict[str, torch.Tensor], r: int, free: torch.cuda.Event | None,
               main: torch.cuda.Stream) -> dict[str, torch.Tensor]:
        """The layer's host tensors in ring slot r on the device: copied on the side stream
        once `free` (the compute stream's last read of the slot) has passed; the compute
        stream waits."""
        views = self._views(parts, r, main)
        with torch.cuda.stream(self.side):
            if free is not None:
                self.side.wait_event(free)
            for name, t in parts.items():
                views[name].copy_(t, non_blocking=True)
            landed = torch.cuda.Event()
            landed.record(self.side)
        main.wait_event(landed)
        return views

    def _views(self, parts: dict[str, torch.Tensor], r: int, main: torch.cuda.Stream) -> dict[str, torch.Tensor]:
        """Ring slot r carved into the layer's parts (each 256-byte aligned), grown if too small."""
        sizes = {name: -(-t.numel() * t.element_size() // 256) * 256 for name, t in parts.items()}
        need = sum(sizes.values())
        if len(self._ring) < RING or self._ring[r].numel() < need:
            for old in self._ring:
                old.record_stream(self.side)  # freed only once the side stream's copies into it are done
            self._ring = [torch.empty(need, dtype=torch.uint8, device=main.device) for _ in range(RING)]
        views, offset = {}, 0
        for name, t in parts.items():
            nbytes = t.numel() * t.element_size()
            views[name] = self._ring[r][offset:offset + nbytes].view(t.dtype).view(t.shape)
            offset += sizes[name]
        return views


class OverlappedPrefill:
    """A prompt's prefill run one layer at a time as a load lands each layer (SlotLoader.load's
    per_layer): its layer i needs only layer i's K/V and rows, so a cold admission takes about
    the load rather than the load plus the prefill. `start(row, n_ctx, prompt, first_use=True)`
    makes the run (a replay, a capture or an eager LayeredPrefill) at the first layer, once the
    index tables it reads exist; `logits` [1, V] holds the prompt's after the last layer."""

    def __init__(self, start: Callable[..., Any], row: int, n_ctx: int, prompt: list[int]) -> None:
        self._start = lambda: start(row, n_ctx, prompt, first_use=True)
        self._run: Any = None
        self.logits: torch.Tensor | None = None

    def __call__(self, layer: int) -> None:
        if self._run is None:
            self._run = self._start()
        out = self._run.run(1)
        if out is not None:
            self.logits = out


def land_ahead(art: ContextArtifact, check: Callable[[], None] = lambda: None) -> None:
    """Before a slot load takes the runner's lock and a slot: wait (running `check` every
    POLL_S) until a landing artifact's layers up to the last n_layers / LOCKED_SHARE have
    landed; raises its download's error if it failed first (no slot was touched); at once for
    any other artifact."""
    landing = getattr(art, "landing", None)
    if landing is None:
        return
    layer = len(art.layers) - 1 - len(art.layers) // LOCKED_SHARE
    while layer >= 0:
        check()
        try:
            landing.wait(layer, POLL_S)
            return
        except TimeoutError:
            continue
