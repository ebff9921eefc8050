"""Prefill with full attention, capture post-RoPE Q/K/V per layer, build the method's tables."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from ctxcache.artifact import KV_CODECS, ContextArtifact, LayerArtifact
from ctxcache.generation import LayerMajorPrefill
from ctxcache.host_copy import host_copies_mark, to_host, wait_for_host_copies
from ctxcache.kv_codec import CodedKV
from ctxcache.methods import SparseMethod, make_method
from ctxcache.models.attention import QueryCapture
from ctxcache.models.kv_cache import KVCache
from ctxcache.models.loader import LoadedModel
from ctxcache.store.artifact_writer import ArtifactWriter

log = logging.getLogger(__name__)

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}

# newest positions always captured: CTkvr's centroids are the last ceil(centroids / G) queries;
# fewer than keep/4 so the clustering sample stays spread over the context
CAPTURE_TAIL = 1024


# prefill tokens per forward pass by where the model runs: a 32K prefill took 2.23 s at 4096
# against 3.96 s at 1024 on the H100 (random Llama-3.1-8B, bf16); the CPU keeps 1024
GPU_PREFILL_CHUNK, CPU_PREFILL_CHUNK = 4096, 1024


def prefill_chunk(on_gpu: bool) -> int:
    return GPU_PREFILL_CHUNK if on_gpu else CPU_PREFILL_CHUNK


@dataclass(frozen=True)
class IndexerConfig:
    chunk: int = 1024  # prefill tokens per forward pass (bounds attention memory)
    kv_dtype: str = "float16"  # dtype of K/V as decoded
    kv_codec: str = "int8"  # how the store encodes K/V (ctxcache/kv_codec.py; measured: bench storage)
    progress: bool = True
    # prefill query positions kept per layer (fp16) so Rebuild of a query-built method needs no
    # re-prefill; 0 (default): none. Opt-in: 1536 positions cost 0.57x the fp16 KV bytes for
    # SmolLM2 at 4K tokens, more than everything else stored once the rows are derived.
    store_queries: int = 0
    # prefill query positions captured per layer for the build (spread over the context plus the
    # newest, as query_positions picks them); 0: all. Bounds the build's device memory at long
    # contexts: 16384 positions are 4.3 GB at Llama-3.1-8B shapes where all of 128K are 34 GB,
    # and CSAttention clusters 4096 (max_queries) of them.
    capture_queries: int = 16384
    # hold the K/V as the codec's codes, encoded on the build's device (what the service stores:
    # a GPU build then copies codes, not fp16, to the host, and the store encodes nothing); off,
    # the artifact holds the exact K/V and the store encodes at put (in-memory users: local
    # generation, benches, tests)
    coded_kv: bool = False

    def __post_init__(self) -> None:
        if self.chunk < 1:
            raise ValueError(f"chunk={self.chunk} must be >= 1")
        if self.capture_queries < 0:
            raise ValueError(f"capture_queries={self.capture_queries} must be >= 0")
        if self.store_queries < 0:
            raise ValueError(f"store_queries={self.store_queries} must be >= 0")
        if self.kv_dtype not in _DTYPES:
            raise ValueError(f"kv_dtype={self.kv_dtype!r} must be one of {sorted(_DTYPES)}")
        if self.kv_codec not in KV_CODECS:
            raise ValueError(f"kv_codec={self.kv_codec!r} must be one of {KV_CODECS}")


def build_artifact(lm: LoadedModel, tokens: list[int] | torch.Tensor, method: SparseMethod,
                   config: IndexerConfig = IndexerConfig(), writer: ArtifactWriter | None = None) -> ContextArtifact:
    """Prefill `tokens` and index every layer with `method`; the layers hold what the method
    persists (its compact state), the rest is derived at load (SparseMethod.restore).
    writer: each layer is handed to it as soon as it is built (a store uploads it while the
    next one builds); the caller then finishes the writer with the artifact returned."""
    ids = torch.as_tensor(tokens, dtype=torch.long).flatten()
    n, args = ids.numel(), lm.args
    if n == 0:
        raise ValueError("context is empty: at least one token is needed")
    if n >= args.max_seq_len:
        raise ValueError(f"context of {n} tokens leaves no room to generate within the model's "
                         f"maximum length {args.max_seq_len}")
    device = lm.model.lm_head.weight.device
    cache = lm.model.new_cache(1, max_len=n)
    bounded = 0 < config.capture_queries < n
    capture = QueryCapture(args.n_layers, keep=query_positions(n, config.capture_queries, CAPTURE_TAIL) if bounded else None)
    started = time.perf_counter()
    # layer-major: layer l's K/V and queries are final before layer l + 1 runs, so its K/V go
    # to the writer (and its table build runs) while later layers prefill
    run = LayerMajorPrefill(lm.model, ids[None].to(device), cache, capture, config.chunk)
    kv = _KVHandOver(cache, n, _DTYPES[config.kv_dtype], config, writer, device)
    clock = _LayerClock(device)

    def inputs():
        with tqdm(total=args.n_layers, desc="prefill", unit="layer", disable=not config.progress) as bar:
            for layer in clock.timed(run.layers()):
                bar.update(1)
                kv.hand_over(layer)
                # the method builds where the keys are (SparseMethod.build_layers: on a GPU for
                # CSAttention); each layer's queries are read only when its build needs them
                yield capture.queries(layer), cache.k[layer][0, :, :n], cache.v[layer][0, :, :n]

    built = method.build_layers(inputs(), args.n_layers)
    layers = []
    for layer in tqdm(range(args.n_layers), desc=f"index ({method.name})", unit="layer",
                      disable=not config.progress):
        tables = method.persist(next(built))
        kept = _kept_queries(capture.queries(layer), config.store_queries) if config.store_queries else None
        layers.append(kv.with_tables(layer, tables, kept))
        capture.chunks[layer] = []  # free the queries as we go
        kv.hand_over_tables(layer, layers[-1])
    if next(built, None) is not None:  # (drawing past the last layer also ends the prefill: its logits)
        raise RuntimeError(f"{method.name} built more layers than the model's {args.n_layers}")
    indexed = _synced_now(device)
    wait_for_host_copies(device)
    # the build's phases, for bench tiers' PutContext split (the prefill's blocks alone; the
    # index work ran between its layers)
    log.info("build phases: prefill %.3fs, index and encode %.3fs (between and after the layers), host copies "
             "after %.3fs", clock.seconds(), indexed - started - clock.seconds(), time.perf_counter() - indexed)
    logits = run.logits
    return ContextArtifact(
        model_id=lm.model_id, model_args=args.to_dict(), method=method.name,
        method_params=method.params.to_dict(), tokens=ids.cpu(), last_logits=logits[0].float().cpu(),
        layers=layers, kv_dtype=config.kv_dtype, kv_codec=config.kv_codec)


class _KVHandOver:
    """Each layer's K/V, encoded by the context's codec where the build runs and queued to the
    host as soon as its prefill ends, handed to the writer then (its tables follow once built:
    a CSAttention GPU build clusters 8 layers at a time)."""

    def __init__(self, cache: KVCache, n: int, dtype: torch.dtype, config: IndexerConfig,
                 writer: ArtifactWriter | None, device: torch.device) -> None:
        self.cache, self.n, self.dtype, self.device = cache, n, dtype, device
        self.codec = config.kv_codec if config.coded_kv else "lossless"
        self.kv_codec = config.kv_codec
        # a lossy codec's K/V held decoded are encoded at finish, so nothing is handed over early
        self.writer = writer if config.coded_kv or config.kv_codec == "lossless" else None
        self.layers: dict[int, LayerArtifact] = {}

    def hand_over(self, layer: int) -> None:
        k, v = self.cache.k[layer][0, :, :self.n], self.cache.v[layer][0, :, :self.n]
        self.layers[layer] = _kv_layer(k, v, self.dtype, self.codec, {}, None)
        if self.writer is not None:  # its host copies still landing: the writer waits for them, not the build
            self.writer.add_layer(layer, self.layers[layer], self.kv_codec, host_copies_mark(self.device))

    def with_tables(self, layer: int, tables: dict, queries: torch.Tensor | None) -> LayerArtifact:
        return self.layers.pop(layer).with_tables(tables, queries)  # the K/V tensors the writer holds

    def hand_over_tables(self, layer: int, full: LayerArtifact) -> None:
        """The layer again, whole: the writer stores what it was not handed yet (tables, queries)."""
        if self.writer is not None:
            self.writer.add_layer(layer, full, self.kv_codec, host_copies_mark(self.device))


class _LayerClock:
    """The prefill's own time, its layers' runs summed without the index work between them: CUDA
    events on a GPU (no sync: the index build's launches queue behind the layer as before),
    wall time on a CPU. For the build's phase log."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.spans: list[tuple] = []

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def timed(self, layers: Iterator[int]) -> Iterator[int]:
        it = iter(layers)
        while True:
            start = self._mark()
            layer = next(it, None)
            if layer is None:
                return
            self.spans.append((start, self._mark()))
            yield layer

    def seconds(self) -> float:
        """Call once the device is synced."""
        if self.cuda:
            return sum(a.elapsed_time(b) for a, b in self.spans) / 1e3
        return sum(b - a for a, b in self.spans)


def _synced_now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _kept_queries(q: torch.Tensor, keep: int) -> torch.Tensor:
    """The query sample an artifact stores (fp16, on the host); read only when it stores one:
    concatenating a layer's captured chunks is a copy of every kept query."""
    return to_host(q[:, query_positions(q.shape[1], keep).to(q.device)], torch.half)


def _kv_layer(k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype, kv_codec: str, tables: dict,
              queries: torch.Tensor | None) -> LayerArtifact:
    """A layer whose K/V are encoded by the context's codec where the build ran (on a GPU: the
    int8 codes cross PCIe, half the fp16 bytes, and the host does no float work; encoding on
    the host was most of a 32K PutContext's store write), then queued to the host."""
    if kv_codec == "lossless":
        return LayerArtifact(k=to_host(k, dtype), v=to_host(v, dtype), tables=tables, queries=queries)
    coded = CodedKV.encode(k.to(dtype), v.to(dtype), kv_codec).map(to_host)
    return LayerArtifact(coded=coded, tables=tables, queries=queries)


def query_positions(n: int, keep: int, tail: int | None = None) -> torch.Tensor:
    """Which of n prefill query positions to keep: all when n <= keep; otherwise the last `tail`
    (default keep/4: recency-based methods such as CTkvr read the newest queries) plus the rest
    evenly spaced over the context (query clustering wants the whole context's spread)."""
    if n <= keep:
        return torch.arange(n)
    tail = keep // 4 if tail is None else min(tail, keep)
    spread = torch.linspace(0, n - tail - 1, keep - tail).round().long()
    return torch.cat([spread, torch.arange(n - tail, n)])


def same_method(source: ContextArtifact, method: SparseMethod) -> bool:
    """Whether `method` is the one that built the source's tables (then they convert as they are)."""
    return source.method == method.name and make_method(source.method, source.method_params).params == method.params


def reindex(source: ContextArtifact, method: SparseMethod, kv_codec: str | None = None) -> ContextArtifact:
    """An artifact of this format from a stored one, with no re-prefill: the source's own
    method converts its tables (persist: an old artifact's derived rows are dropped, its
    centroids kept); another method builds new tables from the stored K/V (and, when it is
    query-built, the stored query sample, carried over). kv_codec: None keeps the source's."""
    if same_method(source, method):
        tables = (method.persist(l.tables) for l in source.layers)
    else:
        if method.caps.uses_queries and any(l.queries is None for l in source.layers):
            raise ValueError(f"method {method.name!r} needs the prefill queries, which this artifact did not "
                             "store (PutContext keeps them only when asked: keep_queries)")
        empty_q = torch.empty(0)
        inputs = ((l.queries.float() if method.caps.uses_queries else empty_q, l.k, l.v) for l in source.layers)
        tables = (method.persist(t) for t in method.build_layers(inputs, len(source.layers)))
    layers = [LayerArtifact(l.k, l.v, t, queries=l.queries) for l, t in zip(source.layers, tables)]
    return ContextArtifact(source.model_id, source.model_args, method.name, method.params.to_dict(),
                           source.tokens, source.last_logits, layers, source.kv_dtype,
                           kv_codec=kv_codec or source.kv_codec)


def release_build_memory(lm: LoadedModel) -> None:
    """Hand a GPU build's freed temporaries (GBs at 32K: prefill activations, captured queries,
    k-means) back to the driver: the caching allocator would keep them reserved, and the decode
    side's driver allocations (kernel modules, a new CUDA graph's pool) then find HBM full."""
    if lm.model.lm_head.weight.is_cuda:
        torch.cuda.empty_cache()
