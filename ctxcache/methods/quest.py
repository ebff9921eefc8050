"""Quest: page-level upper bound on q.k from per-page key min/max (Tang et al., 2024).

Offline, per (layer, KV head): pages of `page` consecutive tokens; per page and channel the
min and max key. Online: the bound sum_d max(q_d * min_d, q_d * max_d) >= q.k for every key
of the page; pages are taken in bound order and their tokens read until the token budget is
spent (the last page may be cut, so every step reads exactly K keys, like the other methods).

Choices: GQA, each query head bounds every page and the group's pages are ranked by the sum
over the group of softmax(bound / sqrt(d)) (the oracle's group rule applied to the bound);
RoPE: pages bound post-RoPE keys (as Quest does); min/max are stored in fp16 rounded outwards
(min down, max up) so the bound stays an upper bound for keys stored in fp16 or wider.
Generated keys extend or open pages in a per-stream copy (`append`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ctxcache.methods.base import Capabilities, LayerState, MethodParams, SparseMethod, Tables
from ctxcache.methods.budget import topk_in_region


@dataclass(frozen=True)
class QuestParams(MethodParams):
    BOUNDS: ClassVar[dict[str, tuple[float, float]]] = {"page": (1, 4096)}
    page: int = 16

    def __post_init__(self) -> None:
        if self.page < 1:
            raise ValueError(f"page={self.page} must be >= 1")


def _outward_fp16(x: torch.Tensor, down: bool) -> torch.Tensor:
    """Round x to fp16 towards -inf (down) or +inf, so the rounded value bounds x."""
    h = x.half()
    off = h.float() > x if down else h.float() < x
    step = torch.full_like(h, float("-inf") if down else float("inf"))
    return torch.where(off, torch.nextafter(h, step), h)


def page_bounds(k: torch.Tensor, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k [Hkv, N, D] -> (min, max) [Hkv, ceil(N / page), D] float32; the last page may be short."""
    hkv, n, d = k.shape
    pages = -(-n // page)
    pad = pages * page - n
    kf = k.float()
    lo = torch.cat([kf, kf.new_full((hkv, pad, d), float("inf"))], 1).view(hkv, pages, page, d).amin(2)
    hi = torch.cat([kf, kf.new_full((hkv, pad, d), float("-inf"))], 1).view(hkv, pages, page, d).amax(2)
    return lo, hi


def upper_bound(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """q [Hkv, G, D], lo/hi [Hkv, P, D] -> bound [Hkv, G, P] >= q.k for every key of a page."""
    qe = q.float()[:, :, None]
    return torch.maximum(qe * lo[:, None], qe * hi[:, None]).sum(-1)


class Quest(SparseMethod):
    name = "quest"
    Params = QuestParams
    caps = Capabilities(streaming=True)

    def build(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Tables:
        lo, hi = page_bounds(k, self.params.page)
        return {"page_min": _outward_fp16(lo, down=True), "page_max": _outward_fp16(hi, down=False)}

    def _bounds(self, state: LayerState) -> tuple[torch.Tensor, torch.Tensor]:
        if "page_min" in state.extra:
            return state.extra["page_min"], state.extra["page_max"]
        return state.tables["page_min"].float(), state.tables["page_max"].float()

    def append(self, state: LayerState, k_new: torch.Tensor, start: int) -> None:
        lo, hi = self._bounds(state)
        page, t = self.params.page, k_new.shape[1]
        need = -(-(start + t) // page)
        if need > lo.shape[1]:
            grow = need - lo.shape[1]
            lo = torch.cat([lo, lo.new_full((lo.shape[0], grow, lo.shape[2]), float("inf"))], 1)
            hi = torch.cat([hi, hi.new_full((hi.shape[0], grow, hi.shape[2]), float("-inf"))], 1)
        else:
            lo, hi = lo.clone(), hi.clone()
        pid = (torch.arange(start, start + t, device=k_new.device) // page)[None, :, None].expand_as(k_new)
        lo.scatter_reduce_(1, pid, k_new.float(), reduce="amin")
        hi.scatter_reduce_(1, pid, k_new.float(), reduce="amax")
        state.extra["page_min"], state.extra["page_max"] = lo, hi

    def page_scores(self, state: LayerState, q: torch.Tensor) -> torch.Tensor:
        """Group page scores [Hkv, P] for q [Hq, D]."""
        lo, hi = self._bounds(state)
        bound = upper_bound(q.view(lo.shape[0], -1, q.shape[-1]), lo, hi)
        return (bound * q.shape[-1] ** -0.5).softmax(-1).sum(1)

    def search(self, state: LayerState, q: torch.Tensor, keys: torch.Tensor, lo: int, hi: int,
               k: int) -> torch.Tensor:
        n = keys.shape[1]
        score = self.page_scores(state, q)  # [Hkv, P]
        page_of = torch.arange(n, device=q.device) // self.params.page
        token_score = score[:, page_of]  # [Hkv, n]
        # pages in rank order, tokens in position order inside a page, the last page cut
        order = torch.argsort(token_score, dim=-1, descending=True, stable=True)
        rank = torch.empty_like(order).scatter_(1, order, torch.arange(n, device=q.device).expand_as(order))
        return topk_in_region(-rank.float(), lo, hi, k)
