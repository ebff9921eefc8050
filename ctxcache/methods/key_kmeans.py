"""Key-centric k-means baseline: cluster keys (one centroid per `keys_per_cluster` keys),
rank clusters by the query's attention to their centroids, take whole clusters in rank order.
This is the key-centric search path (Q -> K-centroid -> K) that CSAttention argues against."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ctxcache.methods.base import Capabilities, LayerState, MethodParams, SparseMethod, Tables
from ctxcache.methods.budget import topk_in_region
from ctxcache.methods.kmeans import kmeans
from ctxcache.methods.oracle import group_probabilities


@dataclass(frozen=True)
class KeyKMeansParams(MethodParams):
    BOUNDS: ClassVar[dict[str, tuple[float, float]]] = {
        "keys_per_cluster": (1, 1 << 16), "kmeans_iters": (1, 100), "seed": (0, (1 << 31) - 1)}
    keys_per_cluster: int = 16
    kmeans_iters: int = 10
    seed: int = 0

    def __post_init__(self) -> None:
        if self.keys_per_cluster < 1 or self.kmeans_iters < 1:
            raise ValueError(f"keys_per_cluster={self.keys_per_cluster} and kmeans_iters="
                             f"{self.kmeans_iters} must be >= 1")


class KeyKMeans(SparseMethod):
    name = "key-kmeans"
    Params = KeyKMeansParams
    caps = Capabilities(streaming=True)

    def build(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Tables:
        p: KeyKMeansParams = self.params
        n_clusters = max(1, math.ceil(k.shape[1] / p.keys_per_cluster))
        cent, assign = kmeans(k.float(), n_clusters, p.kmeans_iters, cosine=False, seed=p.seed)
        return {"centroids": cent.half(), "assign": assign.int()}  # [Hkv, C, D], [Hkv, N]

    def build_work(self, n_tokens: int, n_heads: int, n_kv_heads: int) -> float:
        p: KeyKMeansParams = self.params
        return n_kv_heads * n_tokens * math.ceil(n_tokens / p.keys_per_cluster) * (p.kmeans_iters + 1.0)

    def search(self, state: LayerState, q: torch.Tensor, keys: torch.Tensor, lo: int, hi: int,
               k: int) -> torch.Tensor:
        cent = state.tables["centroids"]
        cluster_score = group_probabilities(q, cent).sum(1)  # [Hkv, C]
        assign = self._assignment(state)
        # Whole clusters in rank order: each key takes its cluster's score; ties within a
        # cluster are broken by position so the last cluster is cut cleanly.
        key_score = torch.gather(cluster_score, 1, assign.long())
        rank = key_score.argsort(-1, descending=True).argsort(-1).float()
        return topk_in_region(-rank, lo, hi, k)

    def _assignment(self, state: LayerState) -> torch.Tensor:
        new = state.extra.get("new_assign")
        base = state.tables["assign"]
        return base if new is None else torch.cat([base, new], dim=1)

    def append(self, state: LayerState, k_new: torch.Tensor, start: int) -> None:
        cent = state.tables["centroids"].float()
        d2 = torch.cdist(k_new.float(), cent)  # [Hkv, T, C]
        a = d2.argmin(-1).int()
        old = state.extra.get("new_assign")
        state.extra["new_assign"] = a if old is None else torch.cat([old, a], dim=1)
