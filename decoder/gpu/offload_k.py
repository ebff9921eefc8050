"""The offload runner's K in HBM and its PCIe byte count.

K buffers: each host slot's context's K exactly as decoded ([slots, Hkv, max_len, D] per layer on
the GPU; the host pool then holds V alone), so the selection's re-rank and the attention read K from HBM and
only V crosses PCIe: the selected keys' V that the GPU slot cache misses, and the sinks' and
recent window's V. A slot's buffer is filled when its context loads (its K is decoded on the
GPU, so the copy is device to device) and kept while the context stays in its host slot: a
hot context pays no copy; a new context loaded into the least recently used host slot
overwrites that slot's buffer (the slot's claim is the eviction).

PcieCounter: what a step moves over PCIe, in bytes. The misses are counted on the device
(the slot caches' hits and selected keys); the rest is arithmetic on the host per step from
each row's length, as the kernels read it: the static rows, dense layers' whole rows, the
re-rank's candidates' K (K on the host only) and the step's new key written back.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ctxcache.decoder.gpu.capacity import free_bytes
from ctxcache.methods import Budget
from ctxcache.models.config import ModelArgs


def k_buffer_bytes(args: ModelArgs, slots: int, max_len: int, dtype_bytes: int) -> int:
    """HBM of the K buffers: every layer's K of `slots` host slots of `max_len` tokens."""
    return args.n_layers * slots * args.n_kv_heads * max_len * args.head_dim * dtype_bytes


def k_buffers(args: ModelArgs, slots: int, max_len: int, dtype: torch.dtype, device: torch.device,
              beside_bytes: int = 0) -> list[torch.Tensor]:
    """Zeroed K buffers [slots, Hkv, max_len, D] per layer; ValueError (one line naming the
    sizes and the flags) when they and `beside_bytes` (the slots' index rows, allocated at the
    first load, and V caches) do not fit the GPU's free memory."""
    k = k_buffer_bytes(args, slots, max_len, torch.empty((), dtype=dtype).element_size())
    if device.type == "cuda":
        free = free_bytes(device)
        if k + beside_bytes > free:
            raise ValueError(f"offload K in HBM: {slots} host slots x {max_len} tokens need {k / 2**30:.2f} GiB of K "
                             f"+ {beside_bytes / 2**30:.2f} GiB of index rows and V caches, the GPU has "
                             f"{free / 2**30:.2f} GiB free: "
                             f"fewer --offload-slots, shorter --offload-slot-tokens, or --offload-k host")
    return [torch.zeros(slots, args.n_kv_heads, max_len, args.head_dim, dtype=dtype, device=device)
            for _ in range(args.n_layers)]


@dataclass
class PcieCounter:
    """Bytes over PCIe since start: `host` the host-side arithmetic per step, `steps` the steps
    counted, `prefill` the prompts' prefills' host -> device K/V bytes (not a step's); the misses come from
    the device counters when read (`total`). v_codes (offload_v: V as int8 codes): a V row read
    from the host is head_dim bytes (its fp16 scale is in HBM), and positions from a row's
    context length on are in the HBM tail (the new key is written there, not to the host)."""

    key_bytes: int  # one key's K or V row of one KV head: D x dtype bytes
    n_kv: int
    budget: Budget
    # a step's re-rank candidates for (K, region): CSAttention.search_reads (with reselect the mean
    # over a selection's steps); None: no re-rank
    candidates: Callable[[int, int], int] | None
    sparse_layers: int
    dense_layers: int
    k_hbm: bool
    v_codes: int = 0  # head_dim where V is held as int8 codes (0: V in the model's dtype)
    host: int = 0
    steps: int = 0
    prefill: int = 0

    @property
    def v_bytes(self) -> int:
        """Bytes of one V row of one KV head read from the host."""
        return self.v_codes if self.v_codes else self.key_bytes

    @property
    def per_key(self) -> int:
        """Bytes a key's row of one KV head moves: V, or K and V with K on the host. A miss of a
        position past the context (read from the HBM tail with v_codes) is counted as one that
        crossed: the device counts misses, not where they were (an upper bound, by the tail's
        share of the selection)."""
        return self.v_bytes + (0 if self.k_hbm else self.key_bytes)

    def step(self, lengths: list[int], contexts: list[int] | None = None) -> None:
        """One step over rows whose key counts, after the step's key is written, are `lengths`
        (and whose context lengths are `contexts`: with v_codes only those positions are on the host)."""
        v = k = 0  # rows of every KV head read or written over PCIe
        for i, n in enumerate(lengths):
            lo = min(self.budget.sinks, n)
            hi = max(lo, n - self.budget.recent)
            if self.v_codes:
                c = contexts[i] if contexts is not None else n
                on_host = min(lo, c) + max(0, min(n, c) - hi)  # the static rows before the context's end
                v += self.sparse_layers * on_host + self.dense_layers * min(n, c)
                continue
            # the static rows, the dense layers' every row, the step's new key written to the host
            rows = self.sparse_layers * (lo + n - hi) + self.dense_layers * n + self.sparse_layers + self.dense_layers
            v += rows
            if not self.k_hbm:  # K of those rows too, and the new key's K read back by the index insert
                k += rows + self.sparse_layers + self.dense_layers
                if self.candidates is not None:  # the re-rank's candidates' K, read from the host
                    top = min(max(1, math.ceil(n * self.budget.keep)), hi - lo)
                    k += self.sparse_layers * self.candidates(top, hi - lo)
        self.host += (v * self.v_bytes + k * self.key_bytes) * self.n_kv
        self.steps += 1

    def prefill_bytes(self, n_ctx: int, span: int, layers: int) -> int:
        """What a serial prefill's `layers` copy: the row's first `span` positions (V, or K and V);
        with v_codes the context's codes alone (the prompt's V is in the tail); a pipelined one
        copies the context's alone (offload_prefill.PrefillFetch.h2d_bytes)."""
        if self.v_codes:
            return layers * n_ctx * self.n_kv * self.v_bytes
        return layers * span * self.n_kv * self.per_key

    def total(self, misses: int) -> int:
        """Every counted step's bytes, given the selected keys (per KV head) the slot caches missed."""
        return self.host + misses * self.per_key
