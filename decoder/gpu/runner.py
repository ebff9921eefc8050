"""The fast GPU runner: rows of distinct contexts in one static cache, graph-captured steps.

Slots: the runner owns one KV cache of `slots` rows (and, sparse, one int8 table buffer per
layer of as many rows), each row up to `max_len` tokens. A slot holds one context; a stream
decodes in a slot and, when it ends, the context stays resident there (the HBM tier): the next
stream on that context resets the row to the context's length and skips the load. Idle slots
are reused least recently used first. A step runs the model over the first `bucket` rows
(buckets 1, 2, 4, ... up to `slots`, one CUDA graph each, captured on first use); rows of the
bucket that are not stepped compute a throw-away token at their current position (past any
resident context, overwritten by their next real step) and do not advance; a busy row's follow
state is put back after such a step (SlotRows._unstepped).

Sparse mode: CSAttention's GPU selector + split-K attention per layer (GpuSparseAttention);
dense mode: split-K attention over every cached key (the same engine with every layer dense).
With reselect > 1 a step where every row carries its last selection replays the bucket's lean
graph (CarriedStep: no selector launches), and the engine holds a row due to select while others
carry (`holds`, reselect_phase.py), so the rows' selections fall into phase.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ctxcache.artifact import ContextArtifact
from ctxcache.decoder.gpu.capacity import MAX_NEW, slot_bytes
from ctxcache.decoder.gpu.attention import CarriedStep, GpuDenseAttention, GpuSparseAttention
from ctxcache.decoder.gpu.graph import GraphDecoder
from ctxcache.decoder.gpu.warm_up import warm_up_runner
from ctxcache.decoder.gpu.device_times import DeviceTimes
from ctxcache.decoder.gpu.prefill_graph import Capturing, PrefillGraphs, Replay
from ctxcache.decoder.gpu.reselect_phase import ReselectPhase
from ctxcache.decoder.gpu.slot_rows import SlotRows
from ctxcache.decoder.gpu.slot_load import OverlappedPrefill, SlotLoader, land_ahead
from ctxcache.decoder.gpu.slot_prefill import (PREFILL_SHARE, PREFILL_TOKEN_LAYERS, PrefillAttention, ResidentHead,
                                               layers_per_chunk, padded_length, prompt_input)
from ctxcache.decoder.inflight import StepIO
from ctxcache.decoder.gpu.tables import GpuDenseTables
from ctxcache.decoder.gpu.table_stacks import carried_views, layer_tables, row_of_every_layer
from ctxcache.decoder.reference_attention import SparseConfig
from ctxcache.generation import LayeredPrefill
from ctxcache.methods import make_method
from ctxcache.methods.csattention import CSAttention, CSAttentionParams
from ctxcache.methods.csattention_refs import subspace_permutation
from ctxcache.models.loader import LoadedModel

_log = logging.getLogger(__name__)
SLOW_ADMIT_S = 0.1  # an admission slower than this is logged with where its time went
def serves_index(art: ContextArtifact, params: CSAttentionParams) -> bool:
    """Whether a GPU runner of these CSAttention parameters decodes the artifact's tables."""
    method = make_method(art.method, art.method_params)
    return method.params == params and method.gpu_decodable(art.layers[0].tables)


@dataclass(eq=False)
class Slot:
    index: int
    context_id: str | None = None
    n_ctx: int = 0  # the resident context's length
    length: int = 0  # host copy of the row's cache length
    busy: bool = False
    last_used: float = 0.0
    head: ResidentHead | None = None  # the resident context's head


class GpuRunner(SlotRows):
    """params None: dense mode. Serves streams whose context fits a slot with room for their
    question and answer (`max_new` tokens streamed into the index at most)."""

    takes_landing = True  # begin() loads an artifact still landing a layer at a time (slot_load.py)

    def __init__(self, lm: LoadedModel, params: CSAttentionParams | None, config: SparseConfig, slots: int,
                 max_len: int, max_new: int = MAX_NEW, use_graph: bool = True,
                 prefill_token_layers: int = PREFILL_TOKEN_LAYERS) -> None:
        if slots < 1 or max_len < 2 or max_new < 1 or prefill_token_layers < 1:
            raise ValueError(f"slots={slots}, max_len={max_len}, max_new={max_new}, prefill_token_layers="
                             f"{prefill_token_layers} must be >= 1, >= 2, >= 1, >= 1")
        self.lm, self.params, self.config, self.max_new = lm, params, config, max_new
        self.prefill_token_layers = prefill_token_layers
        self.name = "gpu-dense" if params is None else "gpu-sparse"
        model, a = lm.model, lm.args
        self.device = model.lm_head.weight.device
        self.cache = model.new_cache(slots, max_len=max_len)  # zero-filled: every position stays finite
        self.slots = [Slot(i) for i in range(slots)]
        self.tables: list[GpuDenseTables] | None = None  # sparse: allocated at the first context
        self._tables: GpuDenseTables | None = None  # every layer's rows (table_stacks.layer_tables)
        self.buckets = sorted({min(1 << i, slots) for i in range(slots.bit_length() + 1)})
        self._decoders: dict[int, GraphDecoder] = {}
        self._lean: dict[int, GraphDecoder] = {}  # bucket -> its lean step (reselect > 1)
        self.phase = ReselectPhase(1, slots)  # its span is the attention's (_decoder)
        self.lean_steps = 0  # steps that replayed a lean graph
        self.use_graph = use_graph
        self._perm = (None if params is None or params.layout == "contiguous"
                      else subspace_permutation(a.head_dim, params.subspaces, params.layout).to(self.device))
        self.lock = threading.Condition()  # device buffers are shared: admissions and steps take turns
        self.loads = 0  # contexts copied into a slot (HBM misses)
        self.slot_bytes = slot_bytes(a, params, max_len, max_new, model.lm_head.weight.element_size(),
                                     config.budget.top_k(max_len))
        self.io = StepIO(slots, self.device)
        self.prefill_graphs = PrefillGraphs()
        self.times = DeviceTimes(self.device)
        self._last_step = "step 0"  # the device-time kind of the last launched step
        self.loader = SlotLoader(self.device)
        # a question's follow seed runs beside its prefill layer (slot_prefill.PrefillAttention)
        self._seed_side = (torch.cuda.Stream(self.device) if self.device.type == "cuda" and params is not None
                           and params.follows else None)

    # ---- admission ----------------------------------------------------------------------------
    def accepts(self, art: ContextArtifact, config: SparseConfig, new_tokens: int) -> bool:
        return art.n_tokens + new_tokens <= self.cache.max_len and self.serves(art, config, new_tokens)

    def serves(self, art: ContextArtifact, config: SparseConfig, new_tokens: int) -> bool:
        """Whether the runner decodes this artifact and schedule, whatever its length."""
        if self.params is None:
            return True
        return config == self.config and new_tokens <= self.max_new and serves_index(art, self.params)

    @torch.inference_mode()
    def admit(self, context_id: str, art: ContextArtifact, prompt: list[int], config: SparseConfig,
              max_new: int, check: Callable[[], None] = lambda: None) -> tuple[Slot, torch.Tensor]:
        """Begin, then run every prefill chunk in the caller's thread."""
        t0 = time.perf_counter()
        slot, chunks = self.begin(context_id, art, prompt, config, max_new, check)
        first = next(f for f in chunks if f is not None)
        if time.perf_counter() - t0 > SLOW_ADMIT_S:
            _log.info("slow admission: %.0f ms for a prompt of %d tokens", 1e3 * (time.perf_counter() - t0),
                      len(prompt))
        return slot, first

    @torch.inference_mode()
    def begin(self, context_id: str, art: ContextArtifact, prompt: list[int], config: SparseConfig,
              max_new: int, check: Callable[[], None] = lambda: None) -> tuple[Slot, Iterator[torch.Tensor | None]]:
        """Claim a slot and load the context into it (unless resident); -> (row, chunks): each
        next() of chunks runs a group of the prompt's layers under the runner's lock and gives
        None, the last gives the first logits [V]. The engine runs one chunk per decode step."""
        if len(prompt) >= self.max_new:
            raise ValueError(f"a prompt of {len(prompt)} tokens leaves no room in the {self.max_new}-key index overlay")
        land_ahead(art, check)  # most of a landing download outside the lock (slot_load.py)
        t0 = time.perf_counter()
        with self.lock:
            t_lock = time.perf_counter()
            slot = self._claim(context_id, check, art)
            try:
                loaded = slot.context_id != context_id
                overlap = None
                if loaded:
                    # a prompt's layer i runs as soon as layer i of the context has landed, so a
                    # cold admission takes about the load, not the load plus the prefill
                    overlap = OverlappedPrefill(self._prompt_run, slot.index, art.n_tokens, prompt) \
                        if len(prompt) > 1 else None
                    self._load(slot, context_id, art, overlap)
                if overlap is None:
                    self._reset(slot)
                else:  # the load reset the row's index stream, which the prompt then filled
                    slot.length = slot.n_ctx
                if len(prompt) > 1:
                    # the row's device length points past the prompt at once: a decode step that
                    # runs between chunks computes this idle row's throw-away token there, never
                    # over the prompt's keys
                    self.cache.lengths[slot.index:slot.index + 1].fill_(slot.n_ctx + len(prompt))
                    if overlap is not None:
                        slot.length += len(prompt)
                        chunks = iter([overlap.logits[0]])
                    else:
                        chunks = self._prefill_chunks(slot, prompt)
                else:
                    chunks = self._without_prefill(slot, prompt, art)
            except BaseException:
                self._forget(slot)
                raise
        if time.perf_counter() - t0 > SLOW_ADMIT_S:
            _log.info("slow admission: %.0f ms to claim and load a slot (runner lock wait %.0f ms)",
                      1e3 * (time.perf_counter() - t0), 1e3 * (t_lock - t0))
        return slot, chunks

    def _per_chunk(self, tokens: int) -> int:
        return layers_per_chunk(tokens, self.lm.args.n_layers, self.prefill_token_layers)

    def step_seconds(self) -> float | None:
        """The device time of a replayed step (launched or stepped) of the last batch size lately
        (None before one was measured)."""
        with self.lock:
            ms = self.times.ms(self._last_step)
        return None if ms is None else ms / 1e3

    def _maker(self, row: int, n_ctx: int) -> Callable[[torch.Tensor], LayeredPrefill]:
        """A prefill of inputs [1, T + 1] (slot_prefill.prompt_input: T padded prompt tokens and
        the real count) into `row` after a context of n_ctx tokens, for the engine or for a graph
        capture (which records it: the row's contents do not matter then)."""
        def make(inputs: torch.Tensor) -> LayeredPrefill:
            attn = PrefillAttention(self.tables, row, n_ctx, self._perm, self.lm.args.n_layers, inputs[0, -1:].int(),
                                    self.config.budget, self.config.dense_layers, self._seed_side)
            return LayeredPrefill(self.lm.model, inputs[:, :-1], n_ctx, self.cache.row(row), attn, last=attn.last)
        return make

    @torch.inference_mode()
    def idle_work(self) -> bool:
        """While no stream uses the runner: capture one prefill graph of a key seen before (its
        next admission replays it, even beside decoding streams); -> whether one was captured."""
        with self.lock:
            if any(s.busy for s in self.slots):
                return False
            return self.prefill_graphs.capture_seen(lambda key: self._maker(key[0], key[1]),
                                                    self.lm.args.n_layers, self.device)

    def _padded(self, n_ctx: int, tokens: int) -> int:
        room = min(self.cache.max_len, self.lm.args.max_seq_len) - n_ctx
        return padded_length(tokens, min(room, self.max_new - 1))

    def _prompt_run(self, row: int, n_ctx: int, prompt: list[int], first_use: bool
                    ) -> Replay | Capturing | LayeredPrefill:
        """The prompt's prefill into `row` after n_ctx tokens: replayed, captured as it runs (on the
        key's second use, or its first with first_use: a loading admission hides the capture), or eager."""
        padded = self._padded(n_ctx, len(prompt))
        make = self._maker(row, n_ctx)
        inputs = prompt_input(prompt, padded, self.device)
        return (self.prefill_graphs.prefill((row, n_ctx, padded), inputs, self.lm.args.n_layers, make,
                                            first_use=first_use) or make(inputs))

    def _prefill_chunks(self, slot: Slot, prompt: list[int]) -> Iterator[torch.Tensor | None]:
        """The prompt's prefill of a resident slot, a group of layers per decode step."""
        padded = self._padded(slot.n_ctx, len(prompt))
        kind = f"prefill layer {slot.n_ctx} {padded}"
        run = None
        while True:
            with self.lock, torch.inference_mode():
                try:
                    if run is None:
                        run = self._prompt_run(slot.index, slot.n_ctx, prompt, first_use=False)
                    replayed = isinstance(run, Replay)
                    layers = self._chunk_layers(kind, padded, run.layer) if replayed else self._per_chunk(padded)
                    started, before = self.times.start() if replayed else None, run.layer
                    logits = run.run(layers)
                    self.times.stop(kind, started, units=run.layer - before)  # the last chunk runs fewer
                except BaseException:
                    self._forget(slot)
                    raise
                if logits is not None:
                    slot.length += len(prompt)
            if logits is not None:
                yield logits[0]
                return
            yield None

    def _chunk_layers(self, kind: str, padded: int, done: int) -> int:
        """Layers of a replayed prefill to run beside the next decode step, `done` of them run:
        as few even chunks as keep each within PREFILL_SHARE of that step's device time (both
        measured; each chunk after the first costs the stream a step), else the token-layer
        rule's."""
        layer_ms, step_ms = self.times.ms(kind), self.times.ms(self._last_step)
        if layer_ms is None or step_ms is None:
            return self._per_chunk(padded)
        left = self.lm.args.n_layers - done
        chunks = max(1, math.ceil(left * layer_ms / (PREFILL_SHARE * step_ms)))
        return -(-left // chunks)

    def _load(self, slot: Slot, context_id: str, art: ContextArtifact,
              then: Callable[[int], None] | None = None) -> None:
        """The context into the slot's row, layer by layer; `then(layer)` (the prompt's prefill)
        runs after each layer's K/V and index rows."""
        n, row = art.n_tokens, slot.index
        slot.context_id = None
        method = None if self.params is None else CSAttention(self.params)

        def per_layer(layer: int, stored: dict[str, torch.Tensor]) -> None:
            # the rows are derived on the GPU from the centroids (copied by the loader beside the
            # layer's codes) and the keys just decoded (kernels/load_kernels.int8_rows)
            if method is not None:
                tables = method.restore(stored, self.cache.k[layer][row, :, :n])
                if self.tables is None:
                    chosen = self.config.budget.top_k(self.cache.max_len) if self.params.reselects > 1 else 0
                    self.tables, self._tables = layer_tables(len(art.layers), len(self.slots), tables,
                                                             self.cache.max_len, self.max_new, self.device,
                                                             self.params.follows, chosen)
                    self.carried_rows = carried_views(self._tables, len(art.layers))
                self.tables[layer].load_row(row, tables, n)

        # coded K/V (the default int8) cross PCIe as codes and are decoded in HBM, a layer at a
        # time as they land (decoding on the host was most of a 32K cold load)
        self.loader.load(self.cache, row, art, per_layer, tables=method is not None, then=then)
        self.phase.reset(row)  # load_row reset the row's stream
        slot.context_id, slot.n_ctx, slot.head = context_id, n, ResidentHead.of(art)
        self.loads += 1

    def _reset(self, slot: Slot) -> None:
        self.phase.reset(slot.index)  # as reset_stream's device countdown
        # fill_, never `t[i] = int`: that copies a host scalar, and a pageable copy waits for
        # the whole stream (the decode step in flight) while this thread holds the runner lock
        slot.length = slot.n_ctx
        self.cache.lengths[slot.index:slot.index + 1].fill_(slot.n_ctx)
        if self.tables is not None:  # every layer's row in a launch a field: a launch a field and layer
            # cost ~2.3 ms of host time before a hot admission's first replay (H200, admit_profile)
            self._tables.reset_stream(row_of_every_layer(slot.index, len(self.slots)))

    # ---- decode -------------------------------------------------------------------------------
    def _decoder(self, bucket: int) -> GraphDecoder:
        dec = self._decoders.get(bucket)
        if dec is None:
            a, view = self.lm.args, self.cache.rows(0, bucket)
            if self.params is None:
                attn = GpuDenseAttention(bucket, a.n_kv_heads, self.cache.max_len)
            else:
                tables = [t.rows(0, bucket) for t in self.tables]
                attn = GpuSparseAttention(self.params, tables, self.config.budget, bucket, a.n_heads, a.n_kv_heads,
                                          a.head_dim, self.cache.max_len)
                if attn.reselect != self.phase.reselect:  # the first one (no stream has stepped yet)
                    self.phase = ReselectPhase(attn.reselect, len(self.slots))
            dec = self._decoders[bucket] = GraphDecoder(self.lm.model, view, attn, self.use_graph)
        return dec

    def _step_decoder(self, bucket: int, rows: list[Slot]) -> GraphDecoder:
        """The bucket's graph, or its lean step where every stepped row carries its selection
        (captured with the bucket's first step, so the warm-up captures both)."""
        dec = self._decoder(bucket)
        carried = self.phase.stepped([s.index for s in rows])
        if self.phase.reselect == 1:
            return dec
        lean = self._lean.get(bucket)
        if lean is None:
            lean = self._lean[bucket] = GraphDecoder(self.lm.model, dec.cache, CarriedStep(dec.attn), self.use_graph,
                                                     label=" lean")
            if lean.use_graph:
                lean.capture()
        if not carried:
            return dec
        self.lean_steps += 1
        return lean

    def holds(self, rows: list[Slot]) -> list[bool]:
        """Which of a step's rows the engine holds back a step: due to select while others carry
        (ReselectPhase.holds; none without reselect)."""
        with self.lock:
            return self.phase.holds([s.index for s in rows])

    def warm_up(self, arts: list[ContextArtifact]) -> None:
        """Every kernel compiled and every bucket's graph captured before serving (warm_up.py)."""
        warm_up_runner(self, arts)

    def cache_full(self, row: Slot) -> bool:
        """Full when the row's cache is, or when its index overlay holds max_new streamed keys."""
        return row.length >= self.cache.max_len or row.length - row.n_ctx >= self.max_new

    @torch.inference_mode()  # the row's tensors were made in inference mode (admit, step)
    def release(self, row: Slot) -> None:
        with self.lock:
            # an idle row still computes throw-away tokens in its bucket: at its context's end,
            # where they index into the overlay's first column, never past it
            self._reset(row)
            row.busy, row.last_used = False, time.monotonic()
            self.lock.notify_all()

    def capacity(self) -> tuple[int, int]:
        return len(self.slots), self.slot_bytes

    def offload_hits(self) -> tuple[int, int]:
        return 0, 0  # every slot's K/V are in HBM

    def resident(self) -> list[str]:
        """Context ids held in HBM (busy or idle)."""
        return [s.context_id for s in self.slots if s.context_id is not None]

