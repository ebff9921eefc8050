"""Selection quality and cost on decode queries, per layer, from dense-captured Q/K/V.

For each sampled continuation step t (query at position n-1, keys 0..n-1, the method's
index updated with every continuation key before it) we compare the method's selection in
the searched middle region [sinks, n - recent) with the true top-K there (K = keep * n):

- group target: the GQA group's mean attention probability, the right target for a
  selection shared by the group (the oracle scores 1.0 here by construction);
- per-head target: each query head's own top-K (stricter: one shared selection cannot
  match several heads' different top-K sets; the oracle shows that ceiling).
mass_recall = probability mass of the selected region keys / mass of the true top-K;
topk_recall = |selected and true top-K| / K. output_rel_error = ||o - o_dense|| / ||o_dense||
of the layer's attention output for the same (dense-model) query. selection_cost_us and
dense_cost_us time one search/attend call (or dense attention) for one decode query on this CPU.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

import torch

from ctxcache.methods import Budget, LayerState, SparseMethod, Tables
from ctxcache.methods.budget import distinct_valid

from ctxcache.quality.capture import Captured


def _recalls(p: torch.Tensor, sel: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """p [Hkv, G, R] target probabilities in the region; sel [Hkv, R] bool selection."""
    true = torch.topk(p, k, dim=-1).indices
    mass = (p * sel[:, None]).sum(-1) / torch.gather(p, 2, true).sum(-1).clamp_min(1e-30)
    hit = torch.gather(sel[:, None].expand_as(p), 2, true).float().mean(-1)
    return mass.flatten(), hit.flatten()


def _step_metrics(method: SparseMethod, state, q, keys, values, n: int, budget: Budget,
                  true_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict:
    """true_kv: the keys and values the targets are computed from, when the method reads
    others (K/V through a lossy codec); default: the same."""
    hkv, d = keys.shape[0], keys.shape[-1]
    out, idx = method.attend(state, q, keys, values, n, budget)
    t_keys, t_values = true_kv or (keys, values)
    probs = (torch.einsum("hgd,hnd->hgn", q.view(hkv, -1, d), t_keys) * d ** -0.5).softmax(-1)
    dense = torch.einsum("hgn,hnd->hgd", probs, t_values).reshape_as(out)
    row = {"output_rel_error": ((out - dense).norm() / dense.norm()).item()}
    lo, hi = budget.region(n)
    k = min(budget.top_k(n), hi - lo)
    if k > 0:
        # -1 (a head with fewer keys than the widest, e.g. CSAttention's carried steps) lands in column n, dropped
        sel = torch.zeros(hkv, n + 1, dtype=torch.bool).scatter_(1, torch.where(idx >= 0, idx, n), True)[:, lo:hi]
        region = probs[..., lo:hi]
        mg, tg = _recalls(region.mean(1, keepdim=True), sel, k)
        mh, th = _recalls(region, sel, k)
        row.update(mass_recall=mg.mean().item(), topk_recall=tg.mean().item(),
                   mass_recall_per_head=mh.mean().item(), topk_recall_per_head=th.mean().item(),
                   keys_read_frac=(distinct_valid(idx).float().mean().item()
                                   + method.search_reads(k, hi - lo) - min(k, hi - lo)) / n)
    return row


@torch.inference_mode()
def selection_metrics(method: SparseMethod, tables: list[Tables], cap: Captured, budget: Budget,
                      stride: int = 8, opened: list[LayerState] | None = None,
                      truth: Captured | None = None) -> dict[str, float]:
    """Mean of each metric over all layers, KV/query heads and every `stride`-th decode step.
    `opened`, when given, receives each layer's state after the run (e.g. MagicPIG's sampling
    statistics). truth: the capture the targets come from when `cap` holds decoded (lossy)
    K/V; default: cap itself."""
    sums: dict[str, list[float]] = defaultdict(list)
    n0 = cap.n_context
    total = cap.k[0].shape[1]
    for layer, tab in enumerate(tables):
        q, k, v = cap.q[layer].float(), cap.k[layer].float(), cap.v[layer].float()
        state = method.open(tab)
        for t in range(total - n0):
            pos = n0 + t
            method.append(state, k[:, pos:pos + 1], pos)
            if t % stride:
                continue
            true_kv = None if truth is None else (truth.k[layer][:, :pos + 1].float(), truth.v[layer][:, :pos + 1].float())
            row = _step_metrics(method, state, q[:, pos], k[:, :pos + 1], v[:, :pos + 1], pos + 1, budget, true_kv)
            for name, value in row.items():
                sums[name].append(value)
        if opened is not None:
            opened.append(state)
    return {name: sum(vals) / len(vals) for name, vals in sums.items()}


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
