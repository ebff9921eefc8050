"""Oracle top-K: exact attention probabilities decide. A reference point, not a fast method."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ctxcache.methods.base import Capabilities, LayerState, MethodParams, SparseMethod, Tables
from ctxcache.methods.budget import topk_in_region


@dataclass(frozen=True)
class OracleParams(MethodParams):
    pass


def group_probabilities(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Softmax probabilities [Hkv, G, n] of queries q [Hq, D] over keys [Hkv, n, D]."""
    hkv, _, d = keys.shape
    logits = torch.einsum("hgd,hnd->hgn", q.float().view(hkv, -1, d), keys.float()) * d ** -0.5
    return logits.softmax(-1)


class Oracle(SparseMethod):
    """Keeps the K keys with the largest attention probability summed over the GQA group."""

    name = "oracle"
    Params = OracleParams
    caps = Capabilities(reads_all_keys=True)

    def build(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Tables:
        return {}

    def search(self, state: LayerState, q: torch.Tensor, keys: torch.Tensor, lo: int, hi: int,
               k: int) -> torch.Tensor:
        return topk_in_region(group_probabilities(q, keys).sum(1), lo, hi, k)
