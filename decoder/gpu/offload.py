"""CPU<->GPU decode attention for contexts whose KV does not fit in HBM.

K/V of every layer stay in pinned host memory. The CSAttention tables (list layout, small
at list_fraction 1/64) and selection stay on the GPU; per step only the selected rows (plus
sinks and the recent window) cross PCIe, read zero-copy by kernels.offload_attention. A
GPU slot cache per layer keeps the rows selected lately (capacity: one selection, so the GPU
holds about keep x the KV); each step's hits are read from HBM, misses from the host and
written into slots freed by keys that left the selection. Every step is a fixed sequence of
launches with no host sync, so it can be captured in a CUDA graph."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ctxcache.kernels.offload_attention import offload_attention
from ctxcache.kernels.slot_plan import plan_slots_kernel
from ctxcache.kernels.split_k_attention import choose_splits


@dataclass
class SlotCache:
    """GPU rows of one layer: k/v [B, Hkv, C, D]; tag [B, Hkv, C] the position held by each
    slot (-1 empty); slot_of [B, Hkv, N + 1] the slot holding each position (-1 absent; the
    extra column N takes masked-out writes, so updates need no host-side compaction)."""

    k: torch.Tensor
    v: torch.Tensor
    tag: torch.Tensor
    slot_of: torch.Tensor
    hits: torch.Tensor      # [] int64 running count of selected keys read from the cache
    selected: torch.Tensor  # [] int64 running count of selected keys
    scratch: tuple[torch.Tensor, ...] = ()  # kernel plan: busy, free [B, Hkv, C]; stamp [B*Hkv]; counts [2]
    ring: torch.Tensor | None = None  # [B, Hkv] int32: the slot the next miss takes first (kernels/slot_plan.py)

    @classmethod
    def empty(cls, batch: int, n_kv: int, capacity: int, n_max: int, head_dim: int, dtype: torch.dtype,
              device: torch.device | str, keys: bool = True) -> "SlotCache":
        """keys False: V alone (K is read from an HBM buffer); k is then [B, Hkv, 0, D]."""
        dev = dict(device=device)
        counts = torch.zeros(2, dtype=torch.int64, **dev)  # hits, selected (views below)
        i32 = dict(dtype=torch.int32, **dev)
        return cls(torch.zeros(batch, n_kv, capacity if keys else 0, head_dim, dtype=dtype, **dev),
                   torch.zeros(batch, n_kv, capacity, head_dim, dtype=dtype, **dev),
                   torch.full((batch, n_kv, capacity), -1, **i32), torch.full((batch, n_kv, n_max + 1), -1, **i32),
                   counts[0], counts[1],
                   (torch.zeros(batch, n_kv, capacity, **i32), torch.zeros(batch, n_kv, capacity, **i32),
                    torch.zeros(batch * n_kv, **i32), counts), torch.zeros(batch, n_kv, **i32))

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def rows(self, start: int, end: int) -> "SlotCache":
        """A view of rows [start, end) sharing storage and counts (a batch bucket's cache)."""
        hkv = self.tag.shape[1]
        busy, free, stamp, counts = self.scratch
        return SlotCache(self.k[start:end], self.v[start:end], self.tag[start:end], self.slot_of[start:end],
                         self.hits, self.selected,
                         (busy[start:end], free[start:end], stamp[start * hkv:end * hkv], counts), self.ring[start:end])

    @classmethod
    def layers(cls, layers: int, batch: int, *args, **kwargs) -> tuple[list["SlotCache"], "SlotCache"]:
        """`layers` caches of `batch` rows (`empty`'s arguments), views of one of layers x batch
        rows (returned second; each layer keeps its own counts): a row of every layer is one
        strided slice (table_stacks.row_of_every_layer), cleared in five launches, not five a layer."""
        whole = cls.empty(layers * batch, *args, **kwargs)
        caches = []
        for i in range(layers):
            c = whole.rows(i * batch, (i + 1) * batch)
            counts = torch.zeros_like(whole.scratch[3])
            caches.append(replace(c, hits=counts[0], selected=counts[1], scratch=(*c.scratch[:3], counts)))
        return caches, whole

    def clear_row(self, row: int | slice) -> None:
        """Row `row` (or rows) holds nothing: a new stream (or context) reuses positions whose K/V
        it may rewrite, so rows cached for them would be stale."""
        self.tag[row].fill_(-1)
        self.slot_of[row].fill_(-1)
        # and its eviction order as new (stamps, ring): steps beside a prefill that rewound it
        # must leave the slots its misses take as a lone prefill does
        busy, _, stamp, _ = self.scratch
        busy[row].zero_()
        stamp.view(-1, self.tag.shape[1])[row].zero_()
        self.ring[row].zero_()

    def hit_rate(self) -> float:
        return float(self.hits) / max(1, int(self.selected))


def plan_slots(cache: SlotCache, idx: torch.Tensor, k_sel: torch.Tensor, out: torch.Tensor | None = None,
               block: int = 1024) -> torch.Tensor:
    """plan_slots_ref in one Triton launch (kernels/slot_plan.py); same result and updates."""
    busy, free, stamp, counts = cache.scratch
    out = torch.empty_like(idx) if out is None else out
    return plan_slots_kernel(idx.contiguous(), k_sel, cache.slot_of, cache.tag, busy, free, stamp, cache.ring.view(-1),
                             counts, out, block)


def plan_slots_ref(cache: SlotCache, idx: torch.Tensor, k_sel: torch.Tensor) -> torch.Tensor:
    """Slot plan for selection idx [B, Hkv, K] (first k_sel[b] valid; -1: no key, slot -1) -> slot
    [B, Hkv, K] int32: s >= 0 a hit in slot s; -s-1 the slot a miss is written to. Miss slots are taken from the
    slots that no hit of this step uses, so a kernel never reads a slot it also writes, and
    the cache's bookkeeping (tag, slot_of, the stamps, ring) is updated here for the new contents.
    The slots no step used since the one before last serve first, then last step's, each in ring
    order from the row's pointer, which then moves past the last miss's slot."""
    bsz, hkv, kmax = idx.shape
    cap, n_dummy = cache.tag.shape[-1], cache.slot_of.shape[-1] - 1
    if kmax > cap:
        raise ValueError(f"selection of {kmax} keys exceeds the cache's {cap} slots")
    valid = (torch.arange(kmax, device=idx.device) < k_sel[:, None, None]) & (idx >= 0)
    pos = torch.where(valid, idx.long(), n_dummy)
    held = cache.slot_of.gather(-1, pos)
    hit = valid & (held >= 0)
    miss = valid & ~hit
    # each slot's last step of use (the kernel's busy stamps): hits use theirs now; the rest serve
    # the misses in selection order, those unused last step first, each tier in ring order
    busy, _, stamps, _ = cache.scratch
    stamp = stamps.view(bsz, hkv).long() + 1
    used = torch.cat([busy.long(), torch.zeros_like(busy[..., :1]).long()], -1)
    used.scatter_(-1, torch.where(hit, held.long(), cap), stamp[..., None].expand(bsz, hkv, kmax))
    ring_slots = (cache.ring.long()[..., None] + torch.arange(cap, device=idx.device)) % cap
    used_ring = used[..., :cap].gather(-1, ring_slots)
    ahead = torch.arange(cap, device=idx.device) + cap * (used_ring == stamp[..., None] - 1)  # old tier first
    key = torch.where(used_ring < stamp[..., None], ahead, 3 * cap)  # busy slots last, never taken
    order = ring_slots.gather(-1, key.argsort(dim=-1, stable=True))
    dst = order.gather(-1, (miss.long().cumsum(-1) - 1).clamp(min=0))
    n_miss = miss.long().sum(-1, keepdim=True)
    last = order.gather(-1, (n_miss - 1).clamp(min=0))[..., 0]
    cache.ring.copy_(torch.where(n_miss[..., 0] > 0, (last + 1) % cap, cache.ring.long()).int())
    used.scatter_(-1, torch.where(miss, dst, cap), stamp[..., None].expand(bsz, hkv, kmax))
    busy.copy_(used[..., :cap].int())
    stamps.copy_(stamp.view(-1).int())
    # evict what the miss slots held, then record the new holders
    dst_m = torch.where(miss, dst, cap)
    old = torch.cat([cache.tag, torch.full_like(cache.tag[..., :1], -1)], -1).gather(-1, dst_m)
    cache.slot_of.scatter_(-1, torch.where(old >= 0, old.long(), n_dummy), -1)
    cache.slot_of.scatter_(-1, torch.where(miss, pos, n_dummy), dst.int())
    cache.slot_of[..., n_dummy] = -1
    tag = torch.cat([cache.tag, cache.tag[..., :1]], -1)
    tag.scatter_(-1, dst_m, pos.int())
    cache.tag.copy_(tag[..., :cap])
    cache.hits += hit.sum()
    cache.selected += valid.sum()
    return torch.where(hit, held, torch.where(miss, -dst.int() - 1, -1)).int()


class OffloadAttention:
    """Decode attention of one query per head over host-resident K/V: GPU selection (any
    selector with select(q, tables, lo, hi, k) -> idx), slot plan, zero-copy attention."""

    def __init__(self, selector, tables: list, k_host: list[torch.Tensor], v_host: list[torch.Tensor],
                 sinks: int, recent: int, keep: float, k_max: int, capacity: int | None = None) -> None:
        self.selector, self.tables, self.k_host, self.v_host = selector, tables, k_host, v_host
        self.sinks, self.recent, self.keep, self.k_max = sinks, recent, keep, k_max
        b, hkv, n_max, d = k_host[0].shape
        dev = tables[0].centroids.device
        self.caches = [SlotCache.empty(b, hkv, capacity or k_max, n_max, d, k_host[0].dtype, dev)
                       for _ in k_host]
        self.splits = choose_splits(b * hkv, k_max + sinks + recent)

    def limits(self, n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Budget.region and Budget.top_k on the device (as GpuSparseAttention._limits)."""
        lo = torch.clamp(n, max=self.sinks)
        hi = torch.maximum(lo, n - self.recent)
        k = torch.ceil(n.double() * self.keep).clamp(min=1).long()
        return lo.int(), hi.int(), torch.minimum(k, (hi - lo).long()).clamp(max=self.k_max).int()

    def __call__(self, layer: int, q: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        """q [B, Hq, D] on the GPU, n [B] int32 keys per row -> [B, Hq, D]."""
        lo, hi, k = self.limits(n)
        idx = self.selector.select(q, self.tables[layer], lo, hi, k)
        slot = plan_slots(self.caches[layer], idx, k)
        c = self.caches[layer]
        return offload_attention(q, self.k_host[layer], self.v_host[layer], c.k, c.v, idx, slot, k, n,
                                 self.sinks, self.recent, splits=self.splits)

    def hit_rate(self) -> float:
        hits = sum(int(c.hits) for c in self.caches)
        return hits / max(1, sum(int(c.selected) for c in self.caches))

    def reset_counts(self) -> None:
        for c in self.caches:
            c.hits.zero_()
            c.selected.zero_()
