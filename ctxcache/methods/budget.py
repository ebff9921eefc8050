"""How many keys a sparse step may read: keep ratio, attention sinks, recent window."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Budget:
    """keep: fraction rho of the cached keys chosen by search (K = ceil(rho * N));
    sinks: first tokens always attended; recent: last tokens always attended."""

    keep: float = 0.05
    sinks: int = 4
    recent: int = 32

    def __post_init__(self) -> None:
        if not 0.0 < self.keep <= 1.0:
            raise ValueError(f"keep={self.keep} must be in (0, 1]")
        if self.sinks < 0 or self.recent < 0:
            raise ValueError(f"sinks={self.sinks} and recent={self.recent} must be >= 0")

    def top_k(self, n: int) -> int:
        """Keys chosen by search among n cached keys."""
        return max(1, math.ceil(self.keep * n))

    def region(self, n: int) -> tuple[int, int]:
        """The searched middle region [lo, hi) of n keys (sinks and the recent window excluded)."""
        lo = min(self.sinks, n)
        hi = max(lo, n - self.recent)
        return lo, hi

    def static_indices(self, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Sinks + recent window, the keys every step reads regardless of search (read-only:
        shared, see outside_region)."""
        lo, hi = self.region(n)
        return outside_region(lo, hi, n, torch.device(device))


@functools.lru_cache(maxsize=256)
def outside_region(lo: int, hi: int, n: int, device: torch.device) -> torch.Tensor:
    """[0, lo) then [hi, n) as one long tensor, made once per (lo, hi, n, device) and shared:
    callers must not write it. Why: every layer of every row's decode step needs it for the
    same n, and three torch calls each time were a measurable part of a CPU step."""
    return torch.cat([torch.arange(0, lo, device=device), torch.arange(hi, n, device=device)])


def topk_in_region(scores: torch.Tensor, lo: int, hi: int, k: int) -> torch.Tensor:
    """Indices [..., k'] of the k best scores [..., n] inside [lo, hi), k' = min(k, hi - lo)."""
    k = min(k, hi - lo)
    return torch.topk(scores[..., lo:hi], k, dim=-1, sorted=False).indices + lo


def fp16_keys(scores: torch.Tensor) -> torch.Tensor:
    """Order-preserving int32 codes in [0, 65536) of scores rounded to fp16 (-0 and +0 equal):
    the 16-bit keys the GPU selection ranks (kernels/topk.py)."""
    bits = (scores.float() + 0.0).half().view(torch.int16).int() & 0xFFFF
    return torch.where(bits >= 0x8000, bits ^ 0xFFFF, bits | 0x8000)


def fp16_rank(scores: torch.Tensor) -> torch.Tensor:
    """int64 [..., n] ranking scores [..., n] by their fp16 keys, ties to the lower index: the
    order CSAttention's GPU selection produces, so both paths pick the same keys."""
    n = scores.shape[-1]
    idx = torch.arange(n, device=scores.device)
    return fp16_keys(scores).long() * (1 << 32) + ((1 << 32) - 1 - idx)


def distinct_valid(idx: torch.Tensor) -> torch.Tensor:
    """Distinct indices >= 0 per row of idx [..., K] -> [...] long: the keys really read when
    rows are padded by repeating an index (estimators) or by -1."""
    if idx.shape[-1] == 0:
        return torch.zeros(idx.shape[:-1], dtype=torch.long, device=idx.device)
    s = idx.sort(-1).values
    first = torch.ones_like(s, dtype=torch.bool)
    first[..., 1:] = s[..., 1:] != s[..., :-1]
    return (first & (s >= 0)).sum(-1)
