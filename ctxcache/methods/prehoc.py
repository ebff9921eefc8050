"""Pre-hoc sparsity: Clustered Index Sharing (CIS) with optional PSAW (prehoc-sparsity.txt, IV-A/B).

CIS needs no offline tables. Decode steps are cut into blocks of `block` steps (s); within a
block, a query whose cosine to an earlier reference query exceeds `tau` reuses that reference's
set (the most recent such reference), dilated by +-`radius` neighbours around its top-m indices
(Eq. 13); otherwise it becomes a reference and runs the exact top-k oracle over the middle
region. Sinks and the recent window are always kept (the decoder's Budget). Paper defaults:
tau = 0.8, m = floor(k/3), r = 1, s in {8, 16} (16 here, the paper's throughput default).

PSAW (IV-B, Eq. 15), optional: from layer l_s = floor(start * L) on, the earliest visible
non-sink position is P_l(t) = floor((1 - phi^(alpha (l - l_s)/(L - l_s))) t); the middle region
becomes [max(lo, P_l), hi) and may then hold fewer than k keys (PSAW prunes, it does not refill).
PSAW needs the layer index: the indexer and the benches call `build_layer(q, k, v, layer,
n_layers)` (SparseMethod's layer-aware build), which stores it in the tables; a bare `build`
has no layer and refuses psaw=True.

Choices where the paper is unclear or does not fit this system:
- GQA: the paper shares per query head; here the selection is per KV head (shared by the group,
  like every method here): a reference's set is the oracle top-k of the summed group
  probabilities, and similarity is the mean over the group of the per-head cosines.
- Budget: the shared set is budget-matched to exactly k keys (the paper's CIS-dagger variant
  lowers k for the same reason): the top-m indices and their neighbours first, in rank order,
  then the rest of the reference set in rank order, cut at k; if fewer, recent keys fill.
- Blocks count calls to `search` (one per decode step and layer when SparseConfig.period is 1).
- ETF is prefill-only in the paper and is not applicable to cached-context decoding.
- RoPE: post-RoPE queries for both the oracle and the cosine gate, as in the paper.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from ctxcache.methods.base import Capabilities, LayerState, MethodParams, SparseMethod, Tables
from ctxcache.methods.oracle import group_probabilities


@dataclass(frozen=True)
class PrehocParams(MethodParams):
    BOUNDS: ClassVar[dict[str, tuple[float, float]]] = {
        "block": (1, 4096), "tau": (-1.0, 2.0), "dilate_fraction": (0.0, 1.0), "radius": (0, 64),
        "psaw_start": (0.0, 1.0), "phi": (0.0, 1.0), "alpha": (0.0, 100.0)}
    block: int = 16  # s: decode steps per sharing block
    tau: float = 0.8  # cosine threshold for reuse (> 1 disables sharing)
    dilate_fraction: float = 1 / 3  # m = floor(dilate_fraction * k)
    radius: int = 1  # r
    psaw: bool = False
    psaw_start: float = 0.75  # l_s = floor(psaw_start * L)
    phi: float = 0.7
    alpha: float = 1.0

    def __post_init__(self) -> None:
        if self.block < 1 or self.radius < 0:
            raise ValueError(f"block={self.block} must be >= 1 and radius={self.radius} >= 0")
        if not 0.0 <= self.dilate_fraction <= 1.0:
            raise ValueError(f"dilate_fraction={self.dilate_fraction} must be in [0, 1]")
        if not -1.0 <= self.tau:
            raise ValueError(f"tau={self.tau} must be >= -1")
        if not 0.0 <= self.psaw_start <= 1.0 or not 0.0 < self.phi < 1.0 or self.alpha < 0:
            raise ValueError(f"psaw_start={self.psaw_start} must be in [0, 1], phi={self.phi} in "
                             f"(0, 1), alpha={self.alpha} >= 0")


def psaw_start(layer: int, n_layers: int, t: int, params: PrehocParams) -> int:
    """Eq. 15: earliest visible non-sink position at layer `layer` for t cached tokens."""
    ls = math.floor(params.psaw_start * n_layers)
    if layer < ls or n_layers <= ls:
        return 0
    return math.floor((1 - params.phi ** (params.alpha * (layer - ls) / (n_layers - ls))) * t)


def dilate(ranked: torch.Tensor, m: int, radius: int, lo: int, hi: int, k: int) -> torch.Tensor:
    """Eq. 13, budget-matched: ranked [S] indices (best first) -> up to k distinct indices in
    [lo, hi): the top-m and their +-radius neighbours, then the rest of `ranked`, in that order."""
    offsets = torch.arange(-radius, radius + 1, device=ranked.device)
    offsets = offsets[offsets.abs().argsort(stable=True)]  # 0, -1, 1, -2, 2, ...
    order = torch.cat([(ranked[:m, None] + offsets).flatten(), ranked[m:]])
    order = order[(order >= lo) & (order < hi)]
    at = torch.arange(order.numel(), device=order.device)
    first = torch.full((hi,), order.numel(), device=order.device).scatter_reduce(0, order, at, "amin")
    return order[first[order] == at][:k]  # keep each index's first occurrence


def fill_recent(chosen: torch.Tensor, lo: int, hi: int, k: int) -> torch.Tensor:
    """Top up chosen [S] distinct indices in [lo, hi) with the most recent others, to k."""
    need = min(k, hi - lo) - chosen.numel()
    if need <= 0:
        return chosen
    free = torch.ones(hi - lo, dtype=torch.bool, device=chosen.device)
    free[chosen - lo] = False
    extra = torch.nonzero(free).flatten()[-need:] + lo
    return torch.cat([chosen, extra])


class Prehoc(SparseMethod):
    name = "prehoc"
    Params = PrehocParams
    caps = Capabilities(reads_all_keys=True)

    def build(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Tables:
        if self.params.psaw:
            raise ValueError("psaw=True needs the layer index: use build_layer(q, k, v, layer, "
                             "n_layers) (the indexer does)")
        return {}

    def build_layer(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                    n_layers: int) -> Tables:
        if not 0 <= layer < n_layers:
            raise ValueError(f"layer={layer} must be in [0, n_layers={n_layers})")
        return {"layer": torch.tensor([layer, n_layers])}

    def search(self, state: LayerState, q: torch.Tensor, keys: torch.Tensor, lo: int, hi: int,
               k: int) -> torch.Tensor:
        p: PrehocParams = self.params
        n, hkv = keys.shape[1], keys.shape[0]
        if p.psaw and "layer" in state.tables:
            layer, n_layers = state.tables["layer"].tolist()
            lo = min(max(lo, psaw_start(layer, n_layers, n, p)), hi)
        k_eff = min(k, hi - lo)
        step = state.extra.get("step", 0)
        if step % p.block == 0:
            state.extra["refs"] = []  # (query [Hkv, G, D] unit, ranked [Hkv, k] or None per head)
        state.extra["step"] = step + 1
        qn = F.normalize(q.float().view(hkv, -1, q.shape[-1]), dim=-1)
        ref_of = self._match(state.extra["refs"], qn)
        probs = None
        out, ranked_now = [], [None] * hkv
        for h in range(hkv):
            if ref_of[h] is None:
                if probs is None:
                    probs = group_probabilities(q, keys).sum(1)  # the exact top-k oracle
                ranked = torch.topk(probs[h, lo:hi], k_eff, sorted=True).indices + lo
                ranked_now[h] = ranked
                out.append(ranked)
            else:
                m = math.floor(p.dilate_fraction * k_eff)
                shared = dilate(ref_of[h], m, p.radius, lo, hi, k_eff)
                out.append(fill_recent(shared, lo, hi, k_eff))
        if any(r is not None for r in ranked_now):
            state.extra["refs"].append((qn, ranked_now))
        return torch.stack(out)  # every head holds exactly k_eff

    def _match(self, refs: list, qn: torch.Tensor) -> list:
        """Per KV head, the ranked set of the most recent reference with cosine > tau, or None."""
        found: list = [None] * qn.shape[0]
        for ref_q, ranked in reversed(refs):
            sim = (qn * ref_q).sum(-1).mean(-1)  # [Hkv]
            for h in range(qn.shape[0]):
                if found[h] is None and ranked[h] is not None and float(sim[h]) > self.params.tau:
                    found[h] = ranked[h]
        return found
