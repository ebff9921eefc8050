"""The offload runner: a context whose K/V do not fit the fast runner's HBM slots decodes with
its K/V in page-locked host memory instead of being refused.

Per stream: the K/V of every layer in pinned host memory (exactly their bytes, page_lock),
CSAttention's tables and a slot cache of the keys selected lately on the GPU. A decode step
indexes the new key, selects (and re-ranks) on the GPU like the fast runner, then attends with
kernels.offload_attention: the selected keys found in the slot cache are read from HBM, the
rest (and the sinks and recent window) straight from host memory over PCIe (zero-copy), and
the misses are written into the cache. The re-rank reads its candidates' keys from the host
too. A prompt's prefill copies each layer's K/V to the GPU for dense attention. Streams step
one at a time, without CUDA graphs: this path trades speed for serving at all; the slot
cache's hit rate is what it reports (`hits`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ctxcache.artifact import ContextArtifact
from ctxcache.decoder.gpu.attention import GpuSparseAttention
from ctxcache.decoder.gpu.offload import SlotCache, plan_slots
from ctxcache.decoder.gpu.runner import serves_index
from ctxcache.decoder.gpu.selector import GpuDenseTables
from ctxcache.decoder.reference_attention import SparseConfig
from ctxcache.generation import decode_one_token, prefill
from ctxcache.host_copy import pinned_exact
from ctxcache.kernels.offload_attention import offload_attention
from ctxcache.kernels.split_k_attention import choose_splits
from ctxcache.methods.csattention import CSAttention, CSAttentionParams
from ctxcache.models.attention import causal_attention
from ctxcache.models.kv_cache import KVCache
from ctxcache.models.loader import LoadedModel


ALIGN = 256  # host cache lengths are multiples of this


class HostKVCache(KVCache):
    """One row's K/V [1, Hkv, max_len, D] per layer in pinned host memory, which the decode
    kernels (RoPE + write, index insert, re-rank, attention) address in place."""

    fused_decode_write = True
    fused_prompt_write = False  # a prompt's keys go in by `write`, a copy into host memory

    def __init__(self, n_layers: int, n_kv: int, max_len: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        shape = (1, n_kv, max_len, head_dim)
        self.k = [pinned_exact(shape, dtype) for _ in range(n_layers)]
        self.v = [pinned_exact(shape, dtype) for _ in range(n_layers)]
        self.lengths = torch.zeros(1, dtype=torch.long, device=device)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """A prompt's keys [1, Hkv, T, D] at consecutive positions pos [1, T]."""
        start, t = int(pos[0, 0]), pos.shape[1]
        self.k[layer][:, :, start:start + t].copy_(k)
        self.v[layer][:, :, start:start + t].copy_(v)


class OffloadSparseAttention(GpuSparseAttention):
    """GpuSparseAttention over host K/V: the same selection and re-rank, attention through a
    slot cache per layer (one selection's keys, the K/V of keep x the context on the GPU)."""

    def __init__(self, params: CSAttentionParams, tables: list[GpuDenseTables], config: SparseConfig,
                 n_heads: int, n_kv: int, head_dim: int, max_len: int, dtype: torch.dtype) -> None:
        # fp32 re-rank scores: the 16-bit keys' score kernel failed to compile (LLVM "Cannot select
        # v2f16") at SmolLM2's shapes on the H100; this path is PCIe-bound, the exact order costs nothing
        super().__init__(params, tables, config.budget, 1, n_heads, n_kv, head_dim, max_len, rerank_key16=False)
        device = tables[0].centroids.device
        self.caches = [SlotCache.empty(1, n_kv, self.k_max, max_len, head_dim, dtype, device) for _ in tables]
        b = config.budget
        self.offload_splits = choose_splits(n_kv, self.k_max + b.sinks + b.recent)

    def _prefill(self, layer: int, q: torch.Tensor, cache: KVCache, pos: torch.Tensor) -> torch.Tensor:
        span = int(pos.max()) + 1
        k = cache.k[layer][:, :, :span].to(q.device, non_blocking=True)
        v = cache.v[layer][:, :, :span].to(q.device, non_blocking=True)
        out = causal_attention(q, k, v, pos)
        self._seed(layer, q, k, pos)
        return out

    def _attend(self, layer: int, q: torch.Tensor, cache: KVCache, n: torch.Tensor, idx: torch.Tensor,
                k: torch.Tensor) -> torch.Tensor:
        c = self.caches[layer]
        idx = idx.contiguous()
        slot = plan_slots(c, idx, k)
        return offload_attention(q, cache.k[layer], cache.v[layer], c.k, c.v, idx, slot, k, n, self.budget.sinks,
                                 self.budget.recent, splits=self.offload_splits)

    def hits(self) -> tuple[int, int]:
        """(selected keys read from the slot caches, selected keys) since the stream started."""
        return sum(int(c.hits) for c in self.caches), sum(int(c.selected) for c in self.caches)


@dataclass(eq=False)
class OffloadRow:
    cache: HostKVCache
    attn: OffloadSparseAttention
    n_ctx: int
    max_len: int


class OffloadRunner:
    """Serves CSAttention contexts (the server's parameters) that the runners before it refused
    for room, up to the model's length; each stream holds its own host K/V."""

    name = "gpu-offload"

    def __init__(self, lm: LoadedModel, params: CSAttentionParams, config: SparseConfig, max_new: int = 512) -> None:
        self.lm, self.params, self.config, self.max_new = lm, params, config, max_new
        self.device = lm.model.lm_head.weight.device
        self.hits_total = self.selected_total = 0  # over released streams
        self._live: set[OffloadRow] = set()

    def accepts(self, art: ContextArtifact, config: SparseConfig, new_tokens: int) -> bool:
        if art.n_tokens + new_tokens > self.lm.args.max_seq_len or new_tokens > self.max_new:
            return False
        return config == self.config and serves_index(art, self.params)

    @torch.inference_mode()
    def admit(self, context_id: str, art: ContextArtifact, prompt: list[int], config: SparseConfig,
              max_new: int, check: Callable[[], None] = lambda: None) -> tuple[OffloadRow, torch.Tensor]:
        a, n = self.lm.args, art.n_tokens
        # rounded as the fast runner's slots are: with a length of no alignment, Triton 3.6's
        # LLVM failed to compile the bf16 re-rank score kernel on the H100 (and took the server down)
        max_len = -(-(n + max(len(prompt), 1) + max_new) // ALIGN) * ALIGN
        cache = HostKVCache(a.n_layers, a.n_kv_heads, max_len, a.head_dim, self.lm.model.lm_head.weight.dtype,
                            self.device)
        tables = [self._load_layer(la, cache, layer, n, max_len) for layer, la in enumerate(art.layers)]
        cache.lengths[0:1].fill_(n)  # no host-scalar copy (a stream sync)
        attn = OffloadSparseAttention(self.params, tables, self.config, a.n_heads, a.n_kv_heads, a.head_dim, max_len,
                                      cache.k[0].dtype)
        row = OffloadRow(cache, attn, n, max_len)
        if not prompt:
            first = art.last_logits.to(self.device).float()
        else:
            first = prefill(self.lm.model, torch.tensor([prompt], device=self.device), cache, attn)[0].float()
        self._live.add(row)
        return row, first

    def _load_layer(self, la, cache: HostKVCache, layer: int, n: int, max_len: int) -> GpuDenseTables:
        """Decode the layer's K/V on the GPU (coded K/V cross PCIe as codes), derive its rows
        there, and keep the K/V in the host cache."""
        k = torch.empty(la.kv_shape, dtype=cache.k[layer].dtype, device=self.device)
        v = torch.empty_like(k)
        la.kv_into(k, v)
        cache.k[layer][0, :, :n].copy_(k)
        cache.v[layer][0, :, :n].copy_(v)
        stored = {name: t.to(self.device, non_blocking=True) for name, t in la.tables.items()}
        restored = CSAttention(self.params).restore(stored, k)
        tables = GpuDenseTables.empty(1, restored, max_len, self.max_new, self.device, self.params.follows)
        tables.load_row(0, restored, n)
        return tables

    @torch.inference_mode()
    def step(self, rows: list[OffloadRow], tokens: list[int]) -> torch.Tensor:
        """One model pass per row: each row's K/V are its own host tensors."""
        return torch.cat([decode_one_token(self.lm.model, torch.tensor([tok], device=self.device), row.cache, row.attn)
                          for row, tok in zip(rows, tokens)]).float()

    def cache_full(self, row: OffloadRow) -> bool:
        return int(row.cache.lengths[0]) >= row.max_len

    def release(self, row: OffloadRow) -> None:
        if row in self._live:
            self._live.discard(row)
            hits, selected = row.attn.hits()
            self.hits_total += hits
            self.selected_total += selected

    def evict(self, context_id: str) -> bool:
        return False  # nothing stays resident: each stream loads its own host copy

    def capacity(self) -> tuple[int, int]:
        return 0, 0

    def offload_hits(self) -> tuple[int, int]:
        """(selected keys read from the GPU slot caches, selected keys) over every stream so far."""
        live = [r.attn.hits() for r in list(self._live)]
        return self.hits_total + sum(h for h, _ in live), self.selected_total + sum(s for _, s in live)
