"""Shared fixtures for the sparse-method tests: small random Q/K/V with peaked attention."""

from __future__ import annotations

import torch


def make_qkv(hq: int = 4, hkv: int = 2, n: int = 300, d: int = 32, seed: int = 0):
    """Prefill q [Hq, n, D], k, v [Hkv, n, D] and one decode query [Hq, D]; queries are scaled
    so that attention is peaked, like a trained model's, not flat."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(hkv, n, d, generator=gen)
    v = torch.randn(hkv, n, d, generator=gen)
    q = 3.0 * torch.randn(hq, n, d, generator=gen)
    q_dec = 3.0 * torch.randn(hq, d, generator=gen)
    return q, k, v, q_dec


def dense_out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Exact attention of q [Hq, D] over all keys [Hkv, n, D] -> [Hq, D]."""
    hkv, _, d = k.shape
    p = (torch.einsum("hgd,hnd->hgn", q.view(hkv, -1, d), k) * d ** -0.5).softmax(-1)
    return torch.einsum("hgn,hnd->hgd", p, v).reshape(q.shape)


