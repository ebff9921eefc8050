"""The offload runner: contexts that no HBM slot holds decode with their K/V in page-locked host
memory, all its streams in one batched step.

Host slots: `slots` rows of `max_len` tokens in one page-locked pool (offload_step.HostKVPool);
on the GPU, per row, CSAttention's int8 rows (GpuDenseTables, as a fast-runner slot has), the
context's K (k_hbm, the default: offload_k.k_buffers, filled at the load) and per layer a slot
cache of the V (K too without k_hbm) of the keys selected lately (offload.SlotCache). A step
runs the model once over a bucket of rows (1, 2, 4, ... slots, a CUDA graph each, captured in
the warm-up): index the new keys, select and re-rank on the GPU (the candidates' K read from
HBM, or the host without k_hbm), attend through the slot caches (kernels.offload_attention:
hits from HBM, the rest over PCIe). `pcie` counts the bytes that cross PCIe (pcie_bytes).
Rows of the bucket not stepped compute a throw-away token at their length, as in the fast
runner. A context stays in its host slot after its stream (the next stream skips the load);
a prompt's prefill copies each layer's V (K too without k_hbm) to the GPU for dense attention
serially or a layer ahead on a copy stream (offload_prefill.PrefillFetch), a group of layers per
decode step on the engine thread (`begin`), as the fast runner's admissions; with prefill_graphs
the serial one replays CUDA graphs, captured a layer at a time (offload_prompt.py). v_int8 (the
server's default with int8 contexts): the host slots hold V as the artifacts' int8 codes and an
HBM tail holds the positions after each context (offload_v.py): every reader decodes the codes
to the resident slot's bits, at 0.51x the bytes over PCIe and in the pool.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ctxcache.artifact import ContextArtifact
from ctxcache.decoder.gpu.device_times import DeviceTimes
from ctxcache.decoder.gpu.graph import GraphDecoder
from ctxcache.decoder.gpu.capacity import offload_row_bytes
from ctxcache.decoder.gpu import offload_prompt
from ctxcache.decoder.gpu.offload import SlotCache
from ctxcache.decoder.gpu.offload_k import PcieCounter, k_buffers
from ctxcache.decoder.gpu.offload_prefill import CopyLane, InlineLane, StreamLane
from ctxcache.decoder.gpu.offload_step import HostKVPool, OffloadSparseAttention, carried_bound
from ctxcache.decoder.gpu.offload_v import CodedDense, CodedHostKVPool, k_into
from ctxcache.decoder.gpu.offload_v import refusal as coded_refusal
from ctxcache.decoder.gpu.prefill_graph import PrefillGraphs
from ctxcache.decoder.gpu.runner import serves_index
from ctxcache.decoder.gpu.slot_prefill import PREFILL_SHARE, ResidentHead
from ctxcache.decoder.gpu.slot_rows import SlotRows
from ctxcache.decoder.gpu.tables import GpuDenseTables
from ctxcache.decoder.gpu.table_stacks import carried_views, layer_tables, row_of_every_layer
from ctxcache.decoder.inflight import StepIO
from ctxcache.decoder.reference_attention import SparseConfig
from ctxcache.generation import LayeredPrefill
from ctxcache.kernels.v_codes import kind_of
from ctxcache.methods.csattention import CSAttention, CSAttentionParams
from ctxcache.methods.csattention_refs import subspace_permutation
from ctxcache.models.loader import LoadedModel

ALIGN = 256  # slot lengths are multiples of this
MAX_NEW = 512  # keys a stream may stream into its row's index overlay
# a prompt's layers per chunk until its times are measured: a 32K prompt layer reads 128 MB of host
# K/V (~3 ms at 40 GB/s); a step of 1-8 offloaded 32K streams took 42-280 ms (H200, stage 1)
PREFILL_LAYERS = 4
PREFILL_KIND = "prefill layer key"  # DeviceTimes: a prompt layer's device time per key it reads
REPLAY_KIND = "prefill replay layer key"  # the same of a replayed (or captured) one: prefill_graphs


@dataclass(eq=False)
class HostSlot:
    index: int
    context_id: str | None = None
    n_ctx: int = 0
    length: int = 0  # host copy of the row's cache length
    busy: bool = False
    last_used: float = 0.0
    head: ResidentHead | None = None  # the held context's head: its next stream skips the DRAM tier
    v_kind: int = 0  # v_int8: v_codes.kind_of the held context's decoded dtype
    # after a prefill beside decode steps: puts back what their throw-away tokens changed in this
    # idle row, run just before the row's first real step (a step may still come between)
    settle: Callable[[], None] | None = None


class OffloadRunner(SlotRows):
    """Serves CSAttention contexts (the server's parameters) the runners before it refused for
    room, up to `max_len` tokens with the question and answer, `slots` streams at once."""

    name = "gpu-offload"

    def __init__(self, lm: LoadedModel, params: CSAttentionParams, config: SparseConfig, slots: int = 4,
                 max_len: int = 0, max_new: int = MAX_NEW, use_graph: bool = True,
                 prefill_layers: int = PREFILL_LAYERS, k_hbm: bool = True, v_cache: float = 8.0,
                 pipelined_prefill: bool = False, v_int8: bool = False, prefill_graphs: bool = False,
                 attention_waves: int = 2) -> None:
        """max_len 0: the model's length. prefill_layers: a prompt's layers per chunk beside a
        decode step until both times are measured (a GPU's first prefill; always on a CPU).
        k_hbm: every host slot's K also in HBM (ValueError when it does not fit); else read from
        the host (stage 1: the re-rank's candidates' K cross PCIe every step). v_cache: each slot's
        GPU cache of V rows (K too without k_hbm) per layer and KV head, in selections.
        pipelined_prefill: a prompt's host K/V copied a layer ahead on a copy stream; False:
        serially on the compute stream (the same logits). Serial by default: a lone hot
        admission at 32K measured 63 ms serial vs 85 pipelined on the H200 (bench step_profile
        --admit, d834b1d), bound by the host's launches either way. v_int8: host slots hold V as
        the artifacts' int8 codes (offload_v.CodedHostKVPool, K in HBM only; artifacts not held
        as int8 codes are refused: `refusal`); False: V in the model's dtype, any codec.
        prefill_graphs: the serial prompt prefill padded (slot_prefill.PAD_TO) and replayed as
        CUDA graphs per (row, context length, padded length, V kind), as the fast runner's
        (offload_prompt.py; eager off CUDA, with pipelined_prefill, or once `.broken`); off here,
        on in the server (serve --offload-prefill-graphs). attention_waves: the decode attention's
        programs per SM (split_k_attention.choose_splits's waves)."""
        a = lm.args
        max_len = max_len or a.max_seq_len
        if not 1.0 <= v_cache <= 64.0:
            raise ValueError(f"offload v_cache={v_cache} must be in [1, 64] (selections a slot cache holds)")
        if v_int8 and not k_hbm:
            raise ValueError("offload v_int8 (V as int8 codes in the host slots) needs K in HBM, not --offload-k host")
        if slots < 1 or max_len < 2 or max_new < 1 or prefill_layers < 1 or attention_waves < 1:
            raise ValueError(f"offload slots={slots}, slot tokens={max_len}, max_new={max_new}, prefill_layers="
                             f"{prefill_layers}, attention_waves={attention_waves} must be >= 1, >= 2, >= 1, >= 1, >= 1")
        # rounded as the fast runner's slots are: at a length of no alignment, Triton 3.6's LLVM
        # failed to compile the bf16 re-rank score kernel on the H100 (and took the server down)
        self.max_len = -(-max_len // ALIGN) * ALIGN
        self.lm, self.params, self.config, self.max_new = lm, params, config, max_new
        self.device = lm.model.lm_head.weight.device
        dtype = lm.model.lm_head.weight.dtype
        # int8 V: the positions after a context (max_new of them, one more for a full row's
        # throw-away token in a step that does not step it) in an HBM tail beside the codes
        self.pool = (CodedHostKVPool(a.n_layers, slots, a.n_kv_heads, self.max_len, a.head_dim, dtype, self.device,
                                     max_new + 1) if v_int8 else
                     HostKVPool(a.n_layers, slots, a.n_kv_heads, self.max_len, a.head_dim, dtype, self.device,
                                keys=not k_hbm))
        self.k_hbm, self.v_int8, self.attention_waves = k_hbm, v_int8, attention_waves
        k_max = config.budget.top_k(self.max_len)
        cached = min(self.max_len, math.ceil(v_cache * k_max))
        carried = carried_bound(k_max, params.follows)
        if params.reselects > 1 and cached < min(self.max_len, carried):
            raise ValueError(f"offload v_cache={v_cache} holds {cached} rows, fewer than a carried step's "
                             f"{carried} candidates (reselect={params.reselect}): raise it")
        # what the slots keep in HBM beside K (the tail is allocated above), checked with it: the
        # index rows (made at the first load) and the slot caches (below)
        e, k_row = dtype.itemsize, a.n_layers * a.n_kv_heads * self.max_len * a.head_dim * dtype.itemsize
        beside = slots * (offload_row_bytes(a, params, self.max_len, max_new, e, cached, k_hbm, False) - k_row)
        self.k = k_buffers(a, slots, self.max_len, dtype, self.device, beside) if k_hbm else None
        self.kv = self.pool.with_k(self.k) if k_hbm else self.pool  # what steps and prefills read and write
        self.slots = [HostSlot(i) for i in range(slots)]
        self.buckets = sorted({min(1 << i, slots) for i in range(slots.bit_length() + 1)})
        self.tables: list[GpuDenseTables] | None = None  # made at the first load (shaped like its tables)
        self._tables: GpuDenseTables | None = None  # every layer's rows (layer_tables)
        self._row_views: dict[int, list[GpuDenseTables]] = {}  # _row_tables
        # every layer's caches (and tables) views of one: a row cleared in every layer at once
        self.caches, self._caches = SlotCache.layers(a.n_layers, slots, a.n_kv_heads, cached, self.max_len, a.head_dim,
                                                     dtype, self.device, keys=not k_hbm)
        self.follow = params.follows if params.candidates(k_max, self.max_len) > k_max else 0
        self._perm = (None if params.layout == "contiguous"
                      else subspace_permutation(a.head_dim, params.subspaces, params.layout).to(self.device))
        self._decoders: dict[int, GraphDecoder] = {}
        self.use_graph = use_graph
        self.io = StepIO(slots, self.device)
        self.lock = threading.Condition()  # the pool, tables and caches are shared: admissions and steps take turns
        self.loads = 0  # contexts copied into a host slot
        self.prefill_layers = prefill_layers
        self.pipelined_prefill = pipelined_prefill
        self.prefill_graphs = PrefillGraphs() if prefill_graphs else None
        side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # a prefill's copy lane (tests give one that lands its copies late, or early)
        self.prefill_lane: Callable[[], CopyLane] = (lambda: StreamLane(side)) if side is not None else InlineLane
        self.times = DeviceTimes(self.device)
        self._last_step = "step 0"  # the device-time kind of the last launched step
        dense = len({i for i in config.dense_layers if i < a.n_layers})
        self.pcie = PcieCounter(a.head_dim * dtype.itemsize, a.n_kv_heads, config.budget,
                                CSAttention(params).search_reads if params.rerank > 1 else None,
                                a.n_layers - dense, dense, k_hbm, a.head_dim if v_int8 else 0)

    # ---- admission ----------------------------------------------------------------------------
    def accepts(self, art: ContextArtifact, config: SparseConfig, new_tokens: int) -> bool:
        if art.n_tokens + new_tokens > min(self.max_len, self.lm.args.max_seq_len) or new_tokens > self.max_new:
            return False
        return config == self.config and serves_index(art, self.params) and self.refusal(art) is None

    def refusal(self, art: ContextArtifact) -> str | None:
        """Why this runner's host slots cannot hold the artifact's K/V (None: they can): with
        v_int8 its V must be held as int8 codes (offload_v.refusal)."""
        return coded_refusal(art) if self.v_int8 else None

    @torch.inference_mode()
    def admit(self, context_id: str, art: ContextArtifact, prompt: list[int], config: SparseConfig,
              max_new: int, check: Callable[[], None] = lambda: None) -> tuple[HostSlot, torch.Tensor]:
        """Begin, then run every prefill chunk in the caller's thread (the warm-up, tests)."""
        slot, chunks = self.begin(context_id, art, prompt, config, max_new, check)
        return slot, next(f for f in chunks if f is not None)

    @torch.inference_mode()
    def begin(self, context_id: str, art: ContextArtifact, prompt: list[int], config: SparseConfig,
              max_new: int, check: Callable[[], None] = lambda: None) -> tuple[HostSlot, Iterator[torch.Tensor | None]]:
        """Claim a host slot (waiting, running `check`, while all are busy) and load the context
        unless the slot holds it; -> (row, chunks): each next() of chunks runs a group of the
        prompt's layers under the runner's lock and gives None, the last the first logits [V].
        The engine runs one chunk per decode step: offloaded streams decode on while one joins
        (its whole prefill under the lock in the caller's thread stalled them: ITL p99 65x)."""
        if len(prompt) >= self.max_new:
            raise ValueError(f"a prompt of {len(prompt)} tokens leaves no room in the {self.max_new}-key index overlay")
        with self.lock:
            slot = self._claim(context_id, check, art)
            try:
                loaded = slot.context_id != context_id
                if loaded:
                    self._load(slot, context_id, art)
                self._reset(slot)
                if len(prompt) > 1:
                    # a step between chunks computes this idle row's throw-away token past the
                    # prompt (its first decoded token's position), never over the prompt's keys
                    self.pool.lengths[slot.index:slot.index + 1].fill_(slot.n_ctx + len(prompt))
                    chunks = self._prefill_chunks(slot, prompt, loaded)
                else:
                    chunks = self._without_prefill(slot, prompt, art)
            except BaseException:
                self._forget(slot)
                raise
        return slot, chunks

    def _load(self, slot: HostSlot, context_id: str, art: ContextArtifact) -> None:
        """Each layer's K/V decoded on the GPU (coded K/V cross PCIe as codes), its rows derived
        there, the V copied into the host slot, the K into the slot's HBM buffer (k_hbm: a device
        copy, the decoded K exactly) or the host slot. v_int8: K alone decoded on the GPU, V's
        codes and scales copied host to host into the slot (offload_v)."""
        n, row = art.n_tokens, slot.index
        if self.v_int8 and self.refusal(art) is not None:
            raise ValueError(self.refusal(art))
        slot.context_id = None
        method = CSAttention(self.params)
        for layer, la in enumerate(art.layers):
            k = torch.empty(la.kv_shape, dtype=self.pool.v[layer].dtype, device=self.device)
            if self.v_int8:
                k_into(la.coded, k)
                self.pool.load_v(row, layer, la.coded)
            else:
                v = torch.empty_like(k)
                la.kv_into(k, v)
                self.pool.v[layer][row, :, :n].copy_(v)
            self.kv.k[layer][row, :, :n].copy_(k)
            stored = {name: t.to(self.device, non_blocking=True) for name, t in la.tables.items()}
            restored = method.restore(stored, k)
            if self.tables is None:
                chosen = self.config.budget.top_k(self.max_len) if self.params.reselects > 1 else 0
                self.tables, self._tables = layer_tables(len(art.layers), len(self.slots), restored, self.max_len,
                                                         self.max_new, self.device, self.params.follows, chosen)
                self.carried_rows = carried_views(self._tables, len(art.layers))
            self.tables[layer].load_row(row, restored, n)
        if self.v_int8:  # the row's tail starts at its context's end (a failed load keeps the last one's)
            self.pool.set_row(row, n, art.layers[0].coded.dtype)
        slot.context_id, slot.n_ctx, slot.head = context_id, n, ResidentHead.of(art)
        slot.v_kind = kind_of(art.layers[0].coded.dtype) if self.v_int8 else 0
        self.loads += 1

    def _reset(self, slot: HostSlot) -> None:
        """The row back to its context's end; its slot caches emptied (a new stream rewrites the
        positions after the context, whose cached rows would be stale)."""
        slot.length, slot.settle = slot.n_ctx, None
        self.pool.lengths[slot.index:slot.index + 1].fill_(slot.n_ctx)  # no host-scalar copy (a sync)
        every = row_of_every_layer(slot.index, len(self.slots))
        if self._tables is not None:
            self._tables.reset_stream(every)
        self._caches.clear_row(every)

    def _prefill_chunks(self, slot: HostSlot, prompt: list[int], loaded: bool = False
                        ) -> Iterator[torch.Tensor | None]:
        """The prompt's prefill, a group of layers per next(). The decode steps run between two
        chunks, and after the last until the stream joins the batch, also step this idle row (a
        throw-away token after the prompt; SlotRows puts its follow state back after each): before
        its first real step its streamed-key count is put back and its slot caches emptied (a
        step may have cached prompt positions before their layer ran), as a prefill alone leaves
        them. `loaded`: the admission loaded the row (a graph may be captured at its first use)."""
        run = None
        while True:
            with self.lock, torch.inference_mode():
                try:
                    if run is None:
                        run, fetch, span = offload_prompt.prompt_run(self, slot, prompt, loaded)
                    kind = PREFILL_KIND if isinstance(run, LayeredPrefill) else REPLAY_KIND
                    started, before = self.times.start(), run.layer
                    logits = run.run(self._chunk_layers(span, before, kind))
                    self.times.stop(kind, started, units=(run.layer - before) * span)
                    layers = run.layer - before
                    self.pcie.prefill += (fetch.h2d_bytes(layers) if fetch is not None
                                          else self.pcie.prefill_bytes(slot.n_ctx, span, layers))
                    if logits is not None:
                        slot.length += len(prompt)
                        slot.settle = self._settler(slot.index, len(prompt))
                except BaseException:
                    self._forget(slot)
                    raise
            if logits is not None:
                yield logits[0].float()
                return
            yield None

    def idle_work(self) -> bool:
        """With no stream: one prefill graph of a key seen once captured (offload_prompt)."""
        return offload_prompt.idle_work(self)

    def _row_tables(self, row: int) -> list[GpuDenseTables]:
        """Row `row`'s one-row view of every layer's tables, kept: the seed buffers seed_follow
        makes on a view (two launches a layer) last across prompts, made here, before any prefill
        graph could capture their making."""
        if row not in self._row_views:
            self._row_views[row] = [t.rows(row, row + 1) for t in self.tables]
            for t in self._row_views[row]:
                if self.follow and t.follow_prev is not None:
                    t.seed_buffers()
        return self._row_views[row]

    def _settler(self, row: int, prompt: int) -> Callable[[], None]:
        every = row_of_every_layer(row, len(self.slots))

        def settle() -> None:
            self._tables.stream_count[every].fill_(prompt)  # a throw-away key counted one column more
            self._caches.clear_row(every)
        return settle

    def _settle(self, rows: list[HostSlot]) -> None:
        """Before each step (SlotRows calls it first): joined rows' state put back, and the step's
        PCIe bytes counted over its whole bucket (rows not stepped compute a throw-away token)."""
        bucket = self.slots[:self._bucket(rows)]
        self.pcie.step([s.length + 1 for s in bucket], [s.n_ctx for s in bucket])
        for s in rows:
            if s.settle is not None:
                s.settle()
                s.settle = None

    def _chunk_layers(self, span: int, done: int, kind: str = PREFILL_KIND) -> int:
        """Layers to run beside the next decode step, `done` run: as few even chunks as keep each
        within PREFILL_SHARE of that step's device time (both measured: a prefill layer's time
        per key it reads, eager or replayed by `kind`, a launched step's), else `prefill_layers`."""
        per_key, step_ms = self.times.ms(kind), self.times.ms(self._last_step)
        if per_key is None or step_ms is None:
            return self.prefill_layers
        left = self.lm.args.n_layers - done
        chunks = max(1, math.ceil(left * per_key * span / (PREFILL_SHARE * step_ms)))
        return -(-left // chunks)

    def step_seconds(self) -> float | None:
        """A launched step's device time lately (the engine queues the next one late in it)."""
        with self.lock:
            ms = self.times.ms(self._last_step)
        return None if ms is None else ms / 1e3

    # ---- decode -------------------------------------------------------------------------------
    def _decoder(self, bucket: int) -> GraphDecoder:
        dec = self._decoders.get(bucket)
        if dec is None:
            a = self.lm.args
            attn = OffloadSparseAttention(self.params, [t.rows(0, bucket) for t in self.tables],
                                          [c.rows(0, bucket) for c in self.caches], self.config.budget, bucket,
                                          a.n_heads, a.n_kv_heads, a.head_dim, self.max_len, self.k_hbm,
                                          self.attention_waves)
            attn.dense_layers = self.config.dense_layers
            if self.v_int8:  # dense layers read V's codes too
                attn.dense = CodedDense(bucket, a.n_kv_heads, self.max_len, self.device)
            dec = self._decoders[bucket] = GraphDecoder(self.lm.model, self.kv.rows(0, bucket), attn, self.use_graph)
        return dec

    def attention_splits(self, bucket: int) -> int:
        """The decode attention's splits a row at this bucket (bench step_profile reports them)."""
        return self._decoder(bucket).attn.offload_splits

    def cache_full(self, row: HostSlot) -> bool:
        return row.length >= self.max_len or row.length - row.n_ctx >= self.max_new

    @torch.inference_mode()
    def release(self, row: HostSlot) -> None:
        with self.lock:
            if not row.busy:
                return
            self._reset(row)  # an idle row's throw-away tokens land at its context's end
            row.busy, row.last_used = False, time.monotonic()
            self.lock.notify_all()

    def capacity(self) -> tuple[int, int]:
        return 0, 0  # no HBM slots: its contexts' K/V are in host memory

    def offload_hits(self) -> tuple[int, int]:
        """(selected keys read from the GPU slot caches, selected keys) since start; idle rows'
        throw-away tokens count too."""
        hits, selected = torch.stack([torch.stack((c.hits, c.selected)) for c in self.caches]).sum(0).tolist()
        return hits, selected  # one device read, not two a layer

    def pcie_bytes(self) -> tuple[int, int]:
        """(bytes over PCIe, steps) since start, of the decode steps: the selected keys' V the slot
        caches missed (K too without k_hbm), the static rows and new keys (offload_k.PcieCounter);
        a prompt's prefill copies are in `pcie.prefill`. One device read."""
        hits, selected = self.offload_hits()
        return self.pcie.total(selected - hits), self.pcie.steps

    def warm_up(self, arts: list[ContextArtifact]) -> None:
        """Every kernel compiled and every bucket's graph captured before serving; with prefill
        graphs, a replayed prefill checked against the eager one (a mismatch: eager from then on)."""
        from ctxcache.decoder.gpu.warm_up import warm_up_runner
        warm_up_runner(self, arts)
