"""CSAttention's parameters (the module docstring of methods/csattention.py says why each default).

Their own module so that the GPU build (csattention_build) and the method (csattention) both
import them without importing each other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from ctxcache.methods.base import MethodParams


_CHOICES = {
    "weighting": ("unit", "qnorm", "qproj"),
    "scoring": ("absolute", "relative", "expected"),
    "layout": ("contiguous", "rope_pairs"),
    "group_combine": ("sum", "max", "softmax"),
    "routing": ("head", "group"),
    "table_dtype": ("auto", "float16", "int8"),
}


MAX_RERANK = 64.0  # candidates per selected key: past this the re-rank reads most of the keys


@dataclass(frozen=True)
class CSAttentionParams(MethodParams):
    BOUNDS: ClassVar[dict[str, tuple[float, float]]] = {
        "subspaces": (1, 64), "centroids": (1, 4096), "list_fraction": (1e-6, 1.0), "kmeans_iters": (1, 100),
        "kmeans_batch": (1, 1 << 20), "max_queries": (1, 1 << 20), "backoff_cos": (-1.0, 1.0),
        "backoff_tau": (1, 64), "seed": (0, (1 << 31) - 1), "rerank": (1.0, MAX_RERANK),
        "follow": (0, 1024), "reselect": (1, 64)}
    QUIET_DEFAULTS: ClassVar[frozenset[str]] = frozenset({"follow", "reselect"})
    subspaces: int = 16  # m (DESIGN.md: 16 x 16 keeps the answers of 8 x 128 at a quarter of the rows)
    centroids: int = 16  # C per subspace
    list_fraction: float = 1.0  # alpha: lists keep L = ceil(alpha * N) keys (1.0: dense layout)
    kmeans_iters: int = 10
    kmeans_batch: int | None = None  # None: full-batch Lloyd iterations
    max_queries: int | None = 4096  # prefill queries sampled per KV head for clustering
    backoff_cos: float = -1.0  # below this best cosine, also use the next centroids (-1: off)
    backoff_tau: int = 2
    weighting: str = "qnorm"
    scoring: str = "expected"
    layout: str = "contiguous"
    group_combine: str = "sum"
    routing: str = "group"
    # dense_score storage: int8 rows + per-row scale (integer estimate) or float16; "auto": int8
    # where it applies (the dense layout with group_combine="sum"), else float16
    table_dtype: str = "auto"
    # > 1: propose ceil(rerank * K) keys by the estimate, keep the K best by exact attention
    # (1: the estimate's top-K, what the GPU selector computes). 4: 3 read 0.75x the candidates'
    # K but lost number answers that 4 and the oracle kept (module docstring)
    rerank: float = 4.0
    # > 0: the keys right after this stream's previous step's `follow` best re-ranked keys (per
    # KV head) join the candidates ahead of the estimate's (same count): a head copying a
    # span attends one key further each step, a key the estimate may rank far below the cut.
    # It takes the re-rank's best keys: inert with rerank 1 (see `follows`). 128: the answer
    # retention suite's measured choice (module docstring); contexts stored before it existed
    # keep their ids (QUIET_DEFAULTS) and decode with it (a search parameter, not the index's)
    follow: int = 128
    # > 1 (with a re-rank and follow): the estimate proposes the candidates on one step in
    # `reselect`; the steps between attend and re-rank exactly the previous step's selection, the
    # successors of its `follow` best keys and the keys that entered the region since
    # (csattention_refs.carried_candidates): about K + follow candidates and no estimate, a search
    # parameter like follow. 2: the answers of 1 (six kinds 0.984 vs 0.982, the wide suite 0.973
    # both) at 0.83x its step (H200, 32K x 8: 7.51 vs 9.00 ms); 4 lost python's numbers (DESIGN.md)
    reselect: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        for name, allowed in _CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} must be one of {allowed}")
        for name in ("subspaces", "centroids", "kmeans_iters", "backoff_tau"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        work = self.subspaces * self.centroids * (self.max_queries or 4096)
        if work > 1 << 27:  # k-means distances [Hkv, m, Nq, C] in fp32: bounded memory per layer
            raise ValueError(f"subspaces={self.subspaces} x centroids={self.centroids} x max_queries="
                             f"{self.max_queries} = {work} exceeds {1 << 27}")
        if not 0.0 < self.list_fraction <= 1.0:
            raise ValueError(f"list_fraction={self.list_fraction} must be in (0, 1]")
        if not 1.0 <= self.rerank <= MAX_RERANK:
            raise ValueError(f"rerank={self.rerank} must be in [1, {MAX_RERANK}]")
        if not -1.0 <= self.backoff_cos <= 1.0:
            raise ValueError(f"backoff_cos={self.backoff_cos} must be in [-1, 1]")
        if self.table_dtype == "int8" and not self._int8_applies:
            raise ValueError("table_dtype='int8' quantizes the dense layout's summed estimate: it needs "
                             f"list_fraction=1.0 and group_combine='sum', got {self.list_fraction} and "
                             f"{self.group_combine!r}")
        if self.routing == "group" and self.group_combine != "sum":
            raise ValueError(f"routing='group' estimates the group's summed logits; it needs "
                             f"group_combine='sum', got {self.group_combine!r}")

    @property
    def _int8_applies(self) -> bool:
        return self.list_fraction == 1.0 and self.group_combine == "sum"

    @property
    def int8_tables(self) -> bool:
        """Whether build stores int8 dense rows (see table_dtype)."""
        return self.table_dtype == "int8" or (self.table_dtype == "auto" and self._int8_applies)

    @property
    def gpu_selectable(self) -> bool:
        """Whether the GPU path computes exactly this selection (no backoff, summed group; follow
        with the dense layout only; the exact re-rank in kernels/rerank.Reranker)."""
        return (self.backoff_cos <= -1.0 and self.group_combine == "sum"
                and (self.follows == 0 or self.list_fraction == 1.0)
                and self.weighting in ("unit", "qnorm") and self.scoring in ("absolute", "relative", "expected"))

    @property
    def follows(self) -> int:
        """The previous step's best keys whose successors are promoted: follow, with a re-rank."""
        return self.follow if self.rerank > 1.0 else 0

    @property
    def reselects(self) -> int:
        """Steps a selection spans (the estimate's steps one in reselects): reselect, with a re-rank
        and follow (a carried step's new candidates are follow's successors)."""
        return self.reselect if self.follows > 0 else 1

    def list_length(self, n: int) -> int:
        return max(1, min(n, math.ceil(self.list_fraction * n)))

    def candidates(self, k: int, region: int) -> int:
        """Keys the estimate proposes for a search of k keys in a region of `region` keys."""
        return min(region, math.ceil(self.rerank * k - 1e-9))
