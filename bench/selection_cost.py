"""Per-step selection cost on this machine: one search/attend call for one decode query."""

from __future__ import annotations

import statistics
import time

import torch

from ctxcache.methods import Budget, SparseMethod


def _median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


@torch.inference_mode()
def selection_cost_us(method: SparseMethod, tables: list, cap, budget: Budget, steps: int) -> float:
    """Median wall time (us) of one search (selectors) or attend (estimators) call for one
    decode query of one layer, over all layers and the first `steps` continuation steps."""
    n0, samples = cap.n_context, []
    for layer, tab in enumerate(tables):
        q, k, v = cap.q[layer].float(), cap.k[layer].float(), cap.v[layer].float()
        state = method.open(tab)
        for t in range(min(steps, k.shape[1] - n0)):
            pos = n0 + t
            method.append(state, k[:, pos:pos + 1], pos)
            n = pos + 1
            keys, values = k[:, :n], v[:, :n]
            lo, hi = budget.region(n)
            t0 = time.perf_counter()
            if method.caps.estimator:
                method.attend(state, q[:, pos], keys, values, n, budget)
            else:
                method.search(state, q[:, pos], keys, lo, hi, budget.top_k(n))
            samples.append(time.perf_counter() - t0)
    return _median_us(samples)


@torch.inference_mode()
def dense_cost_us(cap, steps: int) -> float:
    """The same timing for dense attention of the query over every cached key."""
    n0, samples = cap.n_context, []
    for layer in range(len(cap.q)):
        q, k, v = cap.q[layer].float(), cap.k[layer].float(), cap.v[layer].float()
        hkv, d = k.shape[0], k.shape[-1]
        for t in range(min(steps, k.shape[1] - n0)):
            n = n0 + t + 1
            t0 = time.perf_counter()
            p = (torch.einsum("hgd,hnd->hgn", q[:, n - 1].view(hkv, -1, d), k[:, :n]) * d ** -0.5).softmax(-1)
            torch.einsum("hgn,hnd->hgd", p, v[:, :n])
            samples.append(time.perf_counter() - t0)
    return _median_us(samples)
