"""Model runners: what the engine calls to admit a stream and to run one batched decode step.

`ReferenceRunner` is the torch reference path on any device: each stream has its own one-row
cache and sparse state, the step runs the model once over all rows (the weight-bound parts see
the whole batch) while attention and the index stay per row. It is the test oracle of the fast
GPU runner (decoder/gpu/runner.py), which serves the same engine loop.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ctxcache.artifact import ContextArtifact
from ctxcache.decoder.reference_attention import ReferenceSparseAttention, SparseConfig
from ctxcache.decoder.session import restore_on_demand, start_batch
from ctxcache.methods import SparseMethod, Tables
from ctxcache.models.kv_cache import KVCache
from ctxcache.models.loader import LoadedModel


class ContextNotResident(LookupError):
    """A stream came with a runner's resident head (no K/V) but the slot was given to another
    context meanwhile: the caller acquires the whole artifact and starts again."""


class Runner(Protocol):
    name: str

    def accepts(self, art: ContextArtifact, config: SparseConfig, new_tokens: int) -> bool:
        """Whether this runner can serve a stream of this artifact and schedule."""

    def admit(self, context_id: str, art: ContextArtifact, prompt: list[int], config: SparseConfig,
              max_new: int, check: Callable[[], None]) -> tuple[Any, torch.Tensor]:
        """Load the context and prefill the prompt: -> (row, first logits [V])."""

    def step(self, rows: list[Any], tokens: list[int]) -> torch.Tensor:
        """Decode one token per row: -> logits [B, V]; every row advances by one position."""

    def cache_full(self, row: Any) -> bool: ...

    def release(self, row: Any) -> None: ...

    def evict(self, context_id: str) -> bool:
        """Drop a resident context from device memory once no stream uses it."""

    def capacity(self) -> tuple[int, int]:
        """(contexts it holds resident at once, resident bytes each); (0, 0) when unbounded."""

    def offload_hits(self) -> tuple[int, int]:
        """(selected keys read from a GPU cache of host-resident K/V, selected keys); (0, 0)
        for a runner whose K/V are all on its device."""


@dataclass(eq=False)
class ReferenceRow:
    cache: KVCache
    attn: ReferenceSparseAttention


class _RowCaches:
    """Looks like one KVCache to `Transformer.forward` but writes each row to its own cache."""

    fused_decode_write = fused_prompt_write = False  # rows live in separate tensors: no one-launch RoPE + write

    def __init__(self, caches: list[KVCache]) -> None:
        self.caches = caches

    @property
    def max_len(self) -> int:
        return max(c.max_len for c in self.caches)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        for b, c in enumerate(self.caches):
            c.write(layer, k[b:b + 1], v[b:b + 1], pos[b:b + 1])


class _RowAttention:
    """Runs each row's own attention callable against its own cache."""

    def __init__(self, rows: list[ReferenceRow]) -> None:
        self.rows = rows

    def __call__(self, layer: int, q: torch.Tensor, cache: _RowCaches, pos: torch.Tensor) -> torch.Tensor:
        return torch.cat([r.attn(layer, q[b:b + 1], r.cache, pos[b:b + 1]) for b, r in enumerate(self.rows)])


class RestoredTables:
    """Each context's restored tables, shared by its streams while its artifact object lives.

    Why: restore derives per-context data (CSAttention: the fp64 subspace keys its routed rows
    are computed from, 8x the fp16 K/V bytes) that every stream of a context reads unchanged;
    deriving it per stream cost part of every cached TTFT and one copy per stream in memory.
    Keyed by context id and checked by identity of the artifact (a reloaded artifact restores
    anew); the entry goes with the artifact (weak reference) or with `drop` (an eviction)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_id: dict[str, tuple[weakref.ref, tuple[str, str, str], list[Tables]]] = {}

    def get(self, context_id: str, method: SparseMethod, art: ContextArtifact, device: torch.device,
            keys: list[torch.Tensor] | None = None) -> list[Tables]:
        """keys: the first stream's cached keys (no second decode of coded K/V); restore copies
        what it derives from them, so the shared tables hold no stream's cache."""
        key = (method.name, repr(sorted(art.method_params.items())), str(device))
        with self._lock:
            hit = self._by_id.get(context_id)
        if hit is not None and hit[0]() is art and hit[1] == key:
            return hit[2]
        tables = restore_on_demand(method, art, device, keys)
        ref = weakref.ref(art, lambda _: self._forget(context_id, ref))
        with self._lock:
            self._by_id[context_id] = (ref, key, tables)
        return tables

    def _forget(self, context_id: str, ref: weakref.ref) -> None:
        with self._lock:
            if context_id in self._by_id and self._by_id[context_id][0] is ref:
                del self._by_id[context_id]

    def drop(self, context_id: str) -> bool:
        with self._lock:
            return self._by_id.pop(context_id, None) is not None


class ReferenceRunner:
    """The torch reference decode on the model's device; serves every method and schedule."""

    name = "reference"

    def __init__(self, lm: LoadedModel) -> None:
        self.lm = lm
        self.lock = contextlib.nullcontext()  # rows share no writable buffers: admissions run beside steps
        self._restored = RestoredTables()

    def accepts(self, art: ContextArtifact, config: SparseConfig, new_tokens: int) -> bool:
        return True

    def admit(self, context_id: str, art: ContextArtifact, prompt: list[int], config: SparseConfig,
              max_new: int, check: Callable[[], None] = lambda: None) -> tuple[ReferenceRow, torch.Tensor]:
        first, attn, cache = start_batch(self.lm, [art], [prompt], config, max_new,
                                         lambda method, a, device, keys: self._restored.get(context_id, method, a, device,
                                                                                             keys))
        return ReferenceRow(cache, attn), first[0]

    @torch.inference_mode()
    def step(self, rows: list[ReferenceRow], tokens: list[int]) -> torch.Tensor:
        device = rows[0].cache.lengths.device
        tok = torch.tensor([[t] for t in tokens], device=device)
        pos = torch.cat([r.cache.lengths[:, None] for r in rows])
        logits = self.lm.model(tok, pos, _RowCaches([r.cache for r in rows]), _RowAttention(rows))[:, -1]
        for r in rows:
            r.cache.lengths += 1
        return logits

    def cache_full(self, row: ReferenceRow) -> bool:
        return int(row.cache.lengths[0]) >= row.cache.max_len

    def release(self, row: ReferenceRow) -> None:
        """Nothing to free: the row's cache goes with its last reference."""

    def capacity(self) -> tuple[int, int]:
        return 0, 0  # each stream allocates its own cache

    def offload_hits(self) -> tuple[int, int]:
        return 0, 0

    def evict(self, context_id: str) -> bool:
        return self._restored.drop(context_id)
