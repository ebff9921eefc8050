"""An offloaded row's prompt prefill: dense attention over the row's whole context, its V (K too
without K in HBM) crossing PCIe a layer at a time on a copy stream, a layer ahead of the compute.

Why: a hot question on an offloaded 32K context (Llama-3.1-8B bf16) reads 2.2 GB of V from the
host (~41 ms at the H200's measured 54 GB/s) and computes ~21 ms; copied on the compute stream
the two add up (hot TTFT 116 ms on the H200). Here layer l+1's context V is copied into the
other of two device buffers while layer l computes, and the compute stream waits only for its
own layer's copy (an event), so a prefill takes about max(copy, compute).

What crosses: each layer's context positions [0, n_ctx) a head at a time (a head's span is
contiguous in the pinned pool: one asynchronous DMA each). The prompt's own keys are on the GPU
already (the layer just computed them): `write_prompt` copies them device to device into the
layer's buffer beside the fetched context, where before they went to the host and back. The
values are the same bytes either way, so the logits are those of the serial copy (`to_device`,
kept as the path with `fetch` None). V held as int8 codes (offload_v.py): the serial path decodes
each layer's codes where they are (one dequant launch reading the pinned pool), the pipelined one
copies codes and scales (0.51x the bytes) and decodes them on the compute stream at `get`; the
prompt's V comes from the HBM tail, or is written into the decoded buffer.

Ordering (PrefillFetch): the copy stream first waits for the compute stream's queued work (the
buffers may reuse memory a step still uses); a copy into a buffer waits for the compute stream's
last read of it (`done`, two layers before); the compute stream waits for its layer's copy
(`get`). The buffers are recorded on the copy stream, so a prefill dropped mid-way (a cancel)
frees them only after its copies land.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from ctxcache.decoder.gpu import slot_prefill
from ctxcache.decoder.gpu.tables import GpuDenseTables
from ctxcache.methods import Budget
from ctxcache.models.attention import causal_attention
from ctxcache.models.kv_cache import KVCache
from ctxcache.models.packed_attention import packed_appended_attention, packs

Pairs = list[tuple[torch.Tensor, torch.Tensor]]  # (device destination, host source) of one copy each


class CopyLane(Protocol):
    """Where a prefill's host -> device copies run, and how the compute stream orders with them.
    Markers are opaque (CUDA events on a GPU)."""

    def start(self, buffers: list[torch.Tensor]) -> None: ...
    def copy(self, pairs: Pairs, after: Any) -> Any: ...
    def mark(self) -> Any: ...
    def wait(self, landed: Any) -> None: ...


class StreamLane:
    """Copies on a side CUDA stream (the copy engine: no SMs taken from the compute)."""

    def __init__(self, side: torch.cuda.Stream) -> None:
        self.side = side

    def start(self, buffers: list[torch.Tensor]) -> None:
        self.side.wait_stream(torch.cuda.current_stream())  # freshly allocated buffers: a step may still use the memory
        for b in buffers:
            b.record_stream(self.side)

    def copy(self, pairs: Pairs, after: torch.cuda.Event | None) -> torch.cuda.Event:
        with torch.cuda.stream(self.side):
            if after is not None:
                self.side.wait_event(after)
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            landed = torch.cuda.Event()
            landed.record(self.side)
        return landed

    def mark(self) -> torch.cuda.Event:
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream())
        return done

    def wait(self, landed: torch.cuda.Event) -> None:
        torch.cuda.current_stream().wait_event(landed)


class InlineLane:
    """Copies in program order on the caller's device (a CPU: "host" memory is the device's)."""

    def start(self, buffers: list[torch.Tensor]) -> None:
        pass

    def copy(self, pairs: Pairs, after: None) -> None:
        for dst, src in pairs:
            dst.copy_(src)

    def mark(self) -> None:
        return None

    def wait(self, landed: None) -> None:
        pass


class PrefillFetch:
    """A one-row prefill's host parts (per layer: V, and K when it is on the host, each
    [1, Hkv, max_len, D]; or V's int8 codes and scales, `decode` given) on the device a layer
    ahead, in two buffers [1, Hkv, span(, D)] a part: positions [0, n_ctx) copied from the host,
    the prompt's [n_ctx, span) written by the layer. With `decode` (offload_v: codes, scales,
    out) the layer's codes are decoded on the compute stream when it reads them (`get`) into a
    V buffer [1, Hkv, span, D] of `v_dtype`, beside the prompt's V the layer wrote there."""

    def __init__(self, host: list[list[torch.Tensor]], n_ctx: int, span: int, lane: CopyLane,
                 device: torch.device, decode: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None,
                 v_dtype: torch.dtype | None = None) -> None:
        if not 0 <= n_ctx < span:
            raise ValueError(f"a prefill of positions {n_ctx}..{span - 1}: needs 0 <= n_ctx < span")
        self.host, self.n_ctx, self.span, self.lane, self.decode = host, n_ctx, span, lane, decode
        self.buffers = [[torch.empty((1, t.shape[1], span, *t.shape[3:]), dtype=t.dtype, device=device)
                         for t in host[0]] for _ in range(2)]
        lane.start([b for pair in self.buffers for b in pair])
        # what a layer reads, and the prompt's keys are written into: the copied parts, or the decoded V
        codes = host[0][0]
        self.out = self.buffers if decode is None else [
            [torch.empty((1, codes.shape[1], span, codes.shape[3]), dtype=v_dtype, device=device)] for _ in range(2)]
        self.landed: list[Any] = [None] * len(host)
        self.free: list[Any] = [None, None]  # the compute stream's last read of each buffer
        self.fetched = 0  # layers whose copies are queued
        for _ in range(min(2, len(host))):
            self._fetch_next()

    def h2d_bytes(self, layers: int) -> int:
        """Bytes `layers` layers copy from the host (a part already on the device is copied
        device to device: int8 V's scales)."""
        return layers * sum(t[0, :, :self.n_ctx].nbytes for t in self.host[0] if not t.is_cuda)

    def _fetch_next(self) -> None:
        layer = self.fetched
        pairs = [(dst[:, h, :self.n_ctx], src[:, h, :self.n_ctx])
                 for dst, src in zip(self.buffers[layer % 2], self.host[layer]) for h in range(src.shape[1])]
        self.landed[layer] = self.lane.copy(pairs, self.free[layer % 2])
        self.fetched += 1

    def write_prompt(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The layer's prompt keys k, v [1, Hkv, T, D] (on the device, as the pool's write takes
        them) into its buffer after the context: on the compute stream, beside the copy."""
        for dst, src in zip(self.out[layer % 2], (v, k)):
            dst[:, :, self.n_ctx:self.span].copy_(src)

    def get(self, layer: int) -> list[torch.Tensor]:
        """The layer's parts [1, Hkv, span, D] (V, then K when on the host), once landed (codes:
        decoded first, on the compute stream)."""
        self.lane.wait(self.landed[layer])
        if self.decode is not None:
            codes, scales = self.buffers[layer % 2]
            n = self.n_ctx
            self.decode(codes[0, :, :n], scales[0, :, :n], self.out[layer % 2][0][0, :, :n])
        return self.out[layer % 2]

    def done(self, layer: int) -> None:
        """The compute stream has queued its last read of the layer's buffer: the layer two
        ahead may be copied into it."""
        self.free[layer % 2] = self.lane.mark()
        if self.fetched < len(self.host):
            self._fetch_next()


class HostPrefillAttention:
    """One row's prompt (T > 1 tokens) after n_ctx context tokens, a layer at a time: its keys
    indexed (one launch a layer, `insert_span`), then dense attention over the row's K/V on the
    GPU (`fetch`: copied a layer ahead; None: copied serially, `to_device`), packed as a resident
    slot's prompt (models/packed_attention), and follow seeded by the last query (as
    GpuSparseAttention does over HBM). Eager, its launches bound it (H200, 32K, 20 tokens: ~3,700
    launches and 90 ms when it indexed a token a launch and ran SDPA; 1,939 and 60 ms then,
    against 40 ms of copies and 11 of kernels); serially (`fetch` None) it may be captured as
    CUDA graphs and replayed (offload_graphs.py), its prompt then padded (`real`). The engine runs
    its layers in chunks, a decode step of the other rows between two: that step also computes
    this idle row's throw-away token (SlotRows puts the row's follow state back after it)."""

    def __init__(self, tables: list[GpuDenseTables], perm: torch.Tensor | None, budget: Budget, follow: bool,
                 dense_layers: tuple[int, ...], n_ctx: int, fetch: PrefillFetch | None = None,
                 v_kind: int | None = None, real: torch.Tensor | None = None) -> None:
        """v_kind: the row's V is held as int8 codes (offload_v.CodedHostKVPool) decoded to this
        kind (v_codes.kind_of of the artifact's dtype); None: V in the model's dtype. real: the
        prompt is padded to a graph's length (slot_prefill.PAD_TO) and this many (int32 [1],
        device) of its tokens are real: its last slots pad it, after every real token (causal
        attention keeps them out of the real tokens' outputs), and only the real keys are indexed
        and seeded from, by the last real query (`last`, the LayeredPrefill's logits row); None:
        every token is real."""
        self.tables, self.perm, self.budget, self.follow, self.dense_layers = tables, perm, budget, follow, dense_layers
        self.n_ctx, self.fetch, self.v_kind = n_ctx, fetch, v_kind
        self._real = real  # the prompt's real length (int32 [1], device); unpadded: made at the first layer
        self.last = None if real is None else (real - 1).long()
        self._seed: slot_prefill.SeedPadding | None = None  # seed_follow's bounds, made once a prompt

    def __call__(self, layer: int, q: torch.Tensor, cache: KVCache, pos: torch.Tensor) -> torch.Tensor:
        if q.shape[0] != 1 or q.shape[2] < 2:
            raise ValueError(f"a one-row prompt of >= 2 tokens, not q {tuple(q.shape)}")
        t = self.tables[layer]
        span = self.n_ctx + q.shape[2]  # on the host: a device read would wait for the step in flight
        if self.fetch is None:
            k = to_device(cache.k[layer], span, q.device)
            if self.v_kind is None:
                v = to_device(cache.v[layer], span, q.device)
            else:  # int8 codes decoded where they are (one launch), the prompt's V from the HBM tail
                from ctxcache.decoder.gpu.offload_v import v_to_device
                v = v_to_device(cache, layer, self.n_ctx, span, self.v_kind, q.device)
        else:
            parts = self.fetch.get(layer)
            v = parts[0]
            k = parts[1] if len(parts) > 1 else to_device(cache.k[layer], span, q.device)  # K in HBM: a view
        if self._real is None:
            self._real = torch.full((1,), q.shape[2], dtype=torch.int32, device=q.device)
        # the prompt's keys indexed in one launch a layer, as a resident slot's prefill does
        # (slot_prefill): a launch a token and layer was most of a hot admission's host time
        t.insert_span(0, k[0, :, self.n_ctx:span], 0, self.perm, self._real)
        if slot_prefill.PACKED_ATTENTION and packs(q, k):  # each KV head's keys read once, as a resident slot's prompt
            out = packed_appended_attention(q, k.to(q.dtype), v.to(q.dtype))
        else:
            out = causal_attention(q, k, v, pos)
        if self.follow and layer not in self.dense_layers:
            if self._seed is None:  # the same bounds every layer: written once, not 4 launches a layer
                follow = t.follow_prev.shape[-1]
                pad = slot_prefill.SeedPadding
                self._seed = (pad.unpadded(span, self.budget, follow, q.device) if self.last is None
                              else pad.of(self.n_ctx, self._real, q.shape[2], self.budget, follow))
            last = q[0, :, -1] if self.last is None else q[0].index_select(1, self.last)[:, 0]
            t.seed_follow(0, last, k[0], self.budget, self._seed)
        if self.fetch is not None:
            self.fetch.done(layer)
        return out


def to_device(host: torch.Tensor, span: int, device: torch.device) -> torch.Tensor:
    """A one-row host slot's first `span` positions [1, Hkv, span, D] on `device`, a head at a
    time: each head's span is contiguous in the pinned pool, so it goes by one asynchronous DMA
    (the whole [:, :, :span] slice is strided, and torch copies a strided host tensor through a
    pageable contiguous temporary first, a synchronous copy; ~64 MB a layer at 32K)."""
    if host.device == device:
        return host[:, :, :span]
    out = torch.empty((1, host.shape[1], span, host.shape[3]), dtype=host.dtype, device=device)
    for h in range(host.shape[1]):
        out[:, h].copy_(host[:, h, :span], non_blocking=True)
    return out
