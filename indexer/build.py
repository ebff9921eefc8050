"""Prefill with full attention, capture post-RoPE Q/K/V per layer, build the method's tables."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from ctxcache.artifact import ContextArtifact, LayerArtifact
from ctxcache.generation import prefill
from ctxcache.host_copy import to_host, wait_for_host_copies
from ctxcache.methods import SparseMethod
from ctxcache.models.attention import QueryCapture
from ctxcache.models.loader import LoadedModel

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class IndexerConfig:
    chunk: int = 1024  # prefill tokens per forward pass (bounds attention memory)
    kv_dtype: str = "float16"  # dtype of stored K/V
    progress: bool = True
    # prefill query positions kept per layer (fp16) so Rebuild needs no re-prefill; 0: none.
    # CSAttention clusters at most 4096 queries per GQA group; 1536 positions x a group of 3+
    # heads covers that, at 0.6x the KV bytes for SmolLM2 at 4K tokens (all queries: 1.5x).
    store_queries: int = 1536

    def __post_init__(self) -> None:
        if self.chunk < 1:
            raise ValueError(f"chunk={self.chunk} must be >= 1")
        if self.store_queries < 0:
            raise ValueError(f"store_queries={self.store_queries} must be >= 0")
        if self.kv_dtype not in _DTYPES:
            raise ValueError(f"kv_dtype={self.kv_dtype!r} must be one of {sorted(_DTYPES)}")


def build_artifact(lm: LoadedModel, tokens: list[int] | torch.Tensor, method: SparseMethod,
                   config: IndexerConfig = IndexerConfig()) -> ContextArtifact:
    """Prefill `tokens` and index every layer with `method`."""
    ids = torch.as_tensor(tokens, dtype=torch.long).flatten()
    n, args = ids.numel(), lm.args
    if n == 0:
        raise ValueError("context is empty: at least one token is needed")
    if n >= args.max_seq_len:
        raise ValueError(f"context of {n} tokens leaves no room to generate within the model's "
                         f"maximum length {args.max_seq_len}")
    device = lm.model.lm_head.weight.device
    cache = lm.model.new_cache(1, max_len=n)
    capture = QueryCapture(args.n_layers)
    with tqdm(total=n, desc="prefill", unit="tok", disable=not config.progress) as bar:
        logits = prefill(lm.model, ids[None].to(device), cache, capture, config.chunk, bar.update)
    dtype = _DTYPES[config.kv_dtype]
    layers = []
    # the method builds where the keys are (SparseMethod.build_layers: on a GPU for CSAttention);
    # each layer's queries are read only when its build needs them
    inputs = ((capture.queries(layer), cache.k[layer][0, :, :n], cache.v[layer][0, :, :n])
              for layer in range(args.n_layers))
    built = method.build_layers(inputs, args.n_layers)
    for layer in tqdm(range(args.n_layers), desc=f"index ({method.name})", unit="layer",
                      disable=not config.progress):
        q = capture.queries(layer)
        tables = next(built)
        k, v = to_host(cache.k[layer][0, :, :n], dtype), to_host(cache.v[layer][0, :, :n], dtype)
        kept = to_host(q[:, query_positions(n, config.store_queries).to(q.device)], torch.half) \
            if config.store_queries else None
        layers.append(LayerArtifact(k=k, v=v, tables=tables, queries=kept))
        capture.chunks[layer] = []  # free the queries as we go
    wait_for_host_copies(device)
    return ContextArtifact(
        model_id=lm.model_id, model_args=args.to_dict(), method=method.name,
        method_params=method.params.to_dict(), tokens=ids.cpu(), last_logits=logits[0].float().cpu(),
        layers=layers, kv_dtype=config.kv_dtype)


def query_positions(n: int, keep: int) -> torch.Tensor:
    """Which of n prefill query positions to store: all when n <= keep; otherwise the last
    keep/4 (recency-based methods such as CTkvr read the newest queries) plus keep - keep/4
    evenly spaced over the rest (query clustering wants the whole context's spread)."""
    if n <= keep:
        return torch.arange(n)
    tail = keep // 4
    spread = torch.linspace(0, n - tail - 1, keep - tail).round().long()
    return torch.cat([spread, torch.arange(n - tail, n)])


def reindex(source: ContextArtifact, method: SparseMethod) -> ContextArtifact:
    """New tables from the stored K/V (and, for query-built methods, the stored query sample);
    no re-prefill. The query sample is carried over to the new artifact."""
    if method.caps.uses_queries and any(l.queries is None for l in source.layers):
        raise ValueError(f"method {method.name!r} needs the prefill queries, which this artifact did not store")
    empty_q = torch.empty(0)
    inputs = ((l.queries.float() if method.caps.uses_queries else empty_q, l.k, l.v) for l in source.layers)
    tables = method.build_layers(inputs, len(source.layers))
    layers = [LayerArtifact(l.k, l.v, t, queries=l.queries) for l, t in zip(source.layers, tables)]
    return ContextArtifact(source.model_id, source.model_args, method.name, method.params.to_dict(),
                           source.tokens, source.last_logits, layers, source.kv_dtype, source.format_version)
