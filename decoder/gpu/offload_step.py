"""The offload runner's device state and attention: host slots of K/V in one page-locked pool,
and a batched decode step over them (a row's prompt prefill: offload_prefill).

The pool is the fast runner's slot cache moved to the host: [slots, Hkv, max_len, D] per layer,
every layer of K and V one page-locked allocation, so row b of a batch is at a fixed offset
(b x the row stride) and every kernel of the step (RoPE + write, index insert, re-rank,
attention) addresses the batch by strides, as it does HBM slots. One step is one launch
sequence for the whole bucket, with no host sync, so a CUDA graph per bucket holds it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ctxcache.decoder.gpu.attention import GpuSparseAttention, StepLimits
from ctxcache.decoder.gpu.offload import SlotCache, plan_slots
from ctxcache.decoder.gpu.tables import GpuDenseTables
from ctxcache.host_copy import pinned_exact
from ctxcache.kernels.offload_attention import offload_attention
from ctxcache.kernels.split_k_attention import choose_splits
from ctxcache.methods import Budget
from ctxcache.methods.csattention import CSAttentionParams
from ctxcache.models.kv_cache import KVCache


class HostKVPool(KVCache):
    """K/V [slots, Hkv, max_len, D] per layer in page-locked host memory (zeroed), lengths on
    the device (V in the model's dtype; as an int8-coded artifact's codes: offload_v.CodedHostKVPool). A decode step writes its keys by the fused RoPE + write kernel (zero-copy); a
    prompt's keys go in by `write`, a copy into host memory."""

    fused_decode_write = True
    fused_prompt_write = False

    def __init__(self, n_layers: int, slots: int, n_kv: int, max_len: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, keys: bool = True) -> None:
        """keys False: V alone (K lives in HBM buffers, `with_k`); k is then empty."""
        if slots < 1 or max_len < 2:
            raise ValueError(f"offload slots={slots} must be >= 1 and slot tokens={max_len} >= 2")
        # one registration for the whole pool: page-locking is paid per call (~0.4 s per GB)
        pool = pinned_exact((n_layers, 1 + int(keys), slots, n_kv, max_len, head_dim), dtype)
        self.k = [pool[i, 0] for i in range(n_layers)] if keys else []
        self.v = [pool[i, int(keys)] for i in range(n_layers)]
        self.lengths = torch.zeros(slots, dtype=torch.long, device=device)
        self.nbytes = pool.nbytes

    prompt_start: int | None = None  # a prompt's first position, known on the host (rows(): a prefill's view)
    # a prefill's view: also given each layer's prompt keys on the device (offload_prefill.PrefillFetch)
    tap: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """Rows' keys [B, Hkv, T, D] at consecutive positions pos [B, T], from prompt_start (else
        read on the host: the CPU path only, never a captured step on a GPU), a head at a time
        (each head's span is contiguous in the pinned pool: an asynchronous copy). A prefill chunk
        reading the device, or copying synchronously, would wait for the decode step in flight."""
        t = pos.shape[1]
        starts = [self.prompt_start] * pos.shape[0] if self.prompt_start is not None else pos[:, 0].tolist()
        # a head's [T, D] of the projection's output is strided: torch copies a strided device
        # source to the host through a contiguous temporary, a launch per head; one launch here
        crossing = [(dst, src if dst.device == src.device else src.contiguous())
                    for dst, src in ((self.k[layer], k), (self.v[layer], v))]
        for b, start in enumerate(starts):
            for dst, src in crossing:
                if dst.device == src.device:  # K in HBM (with_k): one strided device copy
                    dst[b, :, start:start + t].copy_(src[b], non_blocking=True)
                    continue
                for h in range(src.shape[1]):
                    dst[b, h, start:start + t].copy_(src[b, h], non_blocking=True)
        if self.tap is not None:
            self.tap(layer, k, v)

    def with_k(self, k: list[torch.Tensor]) -> "HostKVPool":
        """A view reading and writing K in `k` (offload_k.k_buffers: HBM, shaped as the pool's K,
        so every kernel's strides hold) and V in this pool."""
        view = self.rows(0, self.v[0].shape[0])
        view.k = list(k)
        view.nbytes = sum(t.nbytes for t in view.k + view.v)
        return view

    def rows(self, start: int, end: int, prompt_start: int | None = None) -> "HostKVPool":
        view = HostKVPool.__new__(HostKVPool)
        view.k = [k[start:end] for k in self.k]
        view.v = [v[start:end] for v in self.v]
        view.lengths = self.lengths[start:end]
        view.nbytes = sum(t.nbytes for t in view.k + view.v)
        view.prompt_start = prompt_start
        return view


def carried_bound(k_max: int, follow: int) -> int:
    """A carried row's candidates at most: its last K, follow's min(F, K) best keys' successors,
    the new key (the carry kernel writes -1 after them)."""
    return k_max + min(follow, k_max) + 1


class OffloadSparseAttention(GpuSparseAttention):
    """GpuSparseAttention over a batch of host slots: the same selection and re-rank (its
    candidates' keys read from the cache's K: HBM buffers with k_hbm, else the host), attention
    through each layer's GPU slot cache (kernels.offload_attention: hits from HBM, the rest from
    the host, misses cached; with k_hbm the cache holds V and K is read from its buffer; over a
    CodedHostKVPool V is read as int8 codes, decoded in the kernel, and its tail, offload_v.py)."""

    def __init__(self, params: CSAttentionParams, tables: list[GpuDenseTables], caches: list[SlotCache],
                 budget: Budget, batch: int, n_heads: int, n_kv: int, head_dim: int, max_len: int,
                 k_hbm: bool = False, waves: int = 2) -> None:
        # K on the host: fp32 re-rank scores (the 16-bit keys' score kernel failed to compile, LLVM
        # "Cannot select v2f16", at SmolLM2's shapes on the H100, forced on; the path is PCIe-bound,
        # the exact order costs nothing). K in HBM: the fast runner's choice, so the re-rank
        # orders the candidates as a resident slot's does (the same greedy tokens)
        super().__init__(params, tables, budget, batch, n_heads, n_kv, head_dim, max_len,
                         rerank_key16=None if k_hbm else False)
        self.caches, self.k_hbm = caches, k_hbm
        # waves: the attention's programs per SM (choose_splits); each reads its misses over PCIe
        # in series, so more may hide more of the link's latency (bench step_profile --offload-waves)
        self.offload_splits = choose_splits(batch * n_kv, self.k_max + budget.sinks + budget.recent, waves=waves)

    def _prefill(self, layer: int, q: torch.Tensor, cache: KVCache, pos: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a prompt's prefill runs through HostPrefillAttention")

    def _attend_carried(self, layer: int, q: torch.Tensor, cache: KVCache, n: torch.Tensor, idx: torch.Tensor,
                        lim: StepLimits, logits: torch.Tensor | None = None) -> torch.Tensor:
        """reselect: through the slot cache as _attend, the rows not carried over their selection
        idx, the carried ones over all their candidates (the selector's idx, -1 after them: no key,
        never cached). The offloaded step has no lean form (CarriedStep), so no logits to write."""
        if logits is not None:
            raise RuntimeError("an offloaded step re-ranks by its own logits launch (no lean step)")
        width = min(self.kc_max, carried_bound(self.k_max, self.follow))
        carried = lim.carried != 0
        own = torch.nn.functional.pad(idx, (0, max(0, width - idx.shape[2])), value=-1)[:, :, :width]
        listed = torch.where(carried[:, None, None], self.selector.idx[:, :, :width], own)
        # (lim.kc bounds the carry kernel's -1 fill by follow's width F; past `width` all are -1)
        return self._attend(layer, q, cache, n, listed, torch.where(carried, lim.kc.clamp(max=width), lim.k))

    def _attend(self, layer: int, q: torch.Tensor, cache: KVCache, n: torch.Tensor, idx: torch.Tensor,
                k: torch.Tensor) -> torch.Tensor:
        c = self.caches[layer]
        slot = plan_slots(c, idx.contiguous(), k)
        # V as int8 codes (offload_v.CodedHostKVPool): the codes on the host, the tail in HBM
        coded = cache.coded(layer) if hasattr(cache, "v_codes") else None
        return offload_attention(q, cache.k[layer], cache.v[layer] if coded is None else cache.v_codes[layer],
                                 None if self.k_hbm else c.k, c.v, idx.contiguous(), slot, k, n, self.budget.sinks,
                                 self.budget.recent, splits=self.offload_splits, coded=coded)
