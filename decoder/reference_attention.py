"""Per-layer attention callable that decodes with a sparse method (reference torch path)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ctxcache.methods import Budget, LayerState, SparseMethod
from ctxcache.methods.budget import distinct_valid
from ctxcache.models.attention import dense_attention, gather_attention
from ctxcache.models.kv_cache import KVCache

# ASCII digits only (str's \d takes any Unicode digit, int() reads it) and a whole match
# ($ also matches before a trailing newline)
_SCHEDULE = re.compile(r"(?P<keep>0?\.\d+|1(\.0*)?)-step-(?P<period>\d+)", re.ASCII)


@dataclass(frozen=True)
class SparseConfig:
    """budget: keys read per step; period: reuse one search for this many steps (the recent
    window still moves every step); dense_layers: layers that always attend densely."""

    budget: Budget = Budget()
    period: int = 1
    dense_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.period < 1:
            raise ValueError(f"period={self.period} must be >= 1")
        if any(i < 0 for i in self.dense_layers):
            raise ValueError(f"dense_layers={self.dense_layers} must be layer indices >= 0")

    @classmethod
    def from_schedule(cls, schedule: str, sinks: int = 4, recent: int = 32,
                      dense_layers: tuple[int, ...] = ()) -> "SparseConfig":
        """Parse the paper's schedule names, e.g. `0.05-step-1`, `0.15-step-4`, `0.20-step-8`."""
        m = _SCHEDULE.fullmatch(schedule)
        if m is None:
            raise ValueError(f"schedule {schedule!r} must look like '0.05-step-1' (keep-step-period)")
        return cls(Budget(float(m["keep"]), sinks, recent), int(m["period"]), dense_layers)


class ReferenceSparseAttention:
    """Dense for multi-token steps (question prefill) and dense layers; otherwise each row's
    query searches with the method and attends to sinks + selection + recent window.

    states[row][layer] hold each row's index state; every key written to the cache after the
    artifact is appended to them (streaming index updates)."""

    def __init__(self, method: SparseMethod, states: list[list[LayerState]], config: SparseConfig) -> None:
        self.method, self.states, self.config = method, states, config
        self._reuse: dict[tuple[int, int], tuple[torch.Tensor, int]] = {}
        self.keys_read = 0  # selected keys attended, summed over rows, layers and KV heads
        self.keys_total = 0  # keys a dense step would have read

    def row_view(self, row: int) -> "ReferenceSparseAttention":
        """The attention of one row, for use with `KVCache.row(row)` (batch of one)."""
        return ReferenceSparseAttention(self.method, [self.states[row]], self.config)

    def __call__(self, layer: int, q: torch.Tensor, cache: KVCache, pos: torch.Tensor) -> torch.Tensor:
        if q.device.type == "cpu":
            return self._attend(layer, q, cache, pos)
        # the methods' decode code makes its scratch tensors without naming a device: on a GPU
        # they land beside the cache (torch's device context; a no-op cost worth skipping on CPU)
        with torch.device(q.device):
            return self._attend(layer, q, cache, pos)

    def _attend(self, layer: int, q: torch.Tensor, cache: KVCache, pos: torch.Tensor) -> torch.Tensor:
        dense_layer = layer in self.config.dense_layers
        # a dense layer never searches: its index state need not follow the new keys
        for b in range(q.shape[0] if not dense_layer else 0):
            self.method.append(self.states[b][layer], cache.k[layer][b, :, pos[b]], int(pos[b, 0]))
        if q.shape[2] > 1 or dense_layer:
            if q.shape[2] > 1 and layer not in self.config.dense_layers:
                self._observe(layer, q, cache, pos)
            return dense_attention(layer, q, cache, pos)
        rows = [self._row(layer, b, q[b, :, 0], cache, int(pos[b, 0]) + 1) for b in range(q.shape[0])]
        return torch.stack(rows)[:, :, None]

    def _observe(self, layer: int, q: torch.Tensor, cache: KVCache, pos: torch.Tensor) -> None:
        """Hand each row's last query of a dense multi-token step (a prompt) to its state: the
        step before the first sparse one (SparseMethod.observe_dense)."""
        if not self.method.observes_dense:
            return
        for b in range(q.shape[0]):
            n = int(pos[b, -1]) + 1
            lo, hi = self.config.budget.region(n)
            self.method.observe_dense(self.states[b][layer], q[b, :, -1], cache.k[layer][b, :, :n], lo, hi)

    def _row(self, layer: int, b: int, q: torch.Tensor, cache: KVCache, n: int) -> torch.Tensor:
        keys, values = cache.k[layer][b, :, :n], cache.v[layer][b, :, :n]
        budget, state = self.config.budget, self.states[b][layer]
        self.keys_total += n * keys.shape[0]
        if self.method.caps.estimator:
            out, idx = self.method.attend(state, q, keys, values, n, budget)
            self.keys_read += int(distinct_valid(idx).sum())  # short rows repeat an index
            return out
        idx, valid = self._select(layer, b, q, keys, n)
        self.keys_read += int(valid.sum()) if valid is not None else idx.numel()
        return gather_attention(q, keys, values, idx, valid)

    def _select(self, layer: int, b: int, q: torch.Tensor, keys: torch.Tensor, n: int):
        budget, period = self.config.budget, self.config.period
        static = budget.static_indices(n, q.device).expand(keys.shape[0], -1)
        lo, hi = budget.region(n)
        if hi <= lo:
            return static, None
        cached = self._reuse.get((layer, b))
        if cached is None or cached[1] + period <= n:
            found = self.method.search(self.states[b][layer], q, keys, lo, hi, budget.top_k(n))
            self._reuse[(layer, b)] = cached = (found, n)
            # keys a search reads beyond those it returns (a re-rank's other candidates)
            self.keys_read += (self.method.search_reads(budget.top_k(n), hi - lo) - found.shape[1]) * found.shape[0]
        found = cached[0]
        # a reused search may now overlap the moved recent window: attend to those once (-1: none)
        valid = torch.cat([torch.ones_like(static, dtype=torch.bool), (found >= 0) & (found < hi)], dim=1)
        return torch.cat([static, found.clamp(min=0)], dim=1), valid
