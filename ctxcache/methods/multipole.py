"""Multipole attention: exact attention for the important key clusters, centroids for the rest
(multipole-attention.txt, Sec. 3.1 to 3.3).

Offline, per (layer, KV head): Euclidean k-means over the keys, one centroid per
`tokens_per_cluster` keys, in blocks of `block` tokens (the final block holds `block` to
`block * (1 + slack)` tokens); key centroid Kc_i, value centroid Vc_i (member means) and size
N_i per cluster. Online (`attend`, an estimator): clusters are ranked by Eq. 1
S_i = exp(q.Kc_i) / sum_j N_j exp(q.Kc_j) averaged over the GQA group (as the paper does) and
taken whole, in rank order, while their tokens fit the budget; every other cluster contributes
N_i exp(q.Kc_i / sqrt(d)) Vc_i (Eq. 2) inside the same softmax as the exact keys.
Generated tokens (Sec. 3.3): the last `local` to 2 * `local` tokens stay unclustered and exact;
every `local` tokens the oldest `local` join the final block: new centroids seeded from them,
then `refine_iters` Lloyd iterations over the final block. This happens lazily in `attend`,
which sees the values the update needs (`append` only receives keys).

Choices where the paper is unclear or differs from this system:
- RoPE: clustering uses post-RoPE keys; the paper's windowed RoPE needs pre-RoPE keys, which
  the artifact does not store. k-means++ seeding (our shared k-means) instead of random init.
- Sinks: positions [0, sinks) are never clustered (paper: 10 sink tokens; here 4, the
  decoder's default). Keys in the step's static set (sinks, recent window) are attended
  exactly and removed from their cluster's N_i for that step.
- Budget: unclustered tokens outside the budget's recent window are charged to the token
  budget, so every method reads about the same number of exact keys (as in the paper's
  comparison). Hierarchical lookup (Sec. 3.4) is not implemented.
- The indices returned as read are the exact keys, [Hkv, K'] (short rows padded by repeating
  an index); the centroids read (2 vectors per cluster) are not counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ctxcache.methods.base import Capabilities, LayerState, MethodParams, SparseMethod, Tables
from ctxcache.methods.budget import Budget, topk_in_region
from ctxcache.methods.kmeans import kmeans, lloyd
from ctxcache.methods.magicpig import padded_indices


@dataclass(frozen=True)
class MultipoleParams(MethodParams):
    BOUNDS: ClassVar[dict[str, tuple[float, float]]] = {
        "tokens_per_cluster": (1, 4096), "block": (1, 1 << 20), "slack": (0.0, 1.0), "local": (1, 4096),
        "sinks": (0, 4096), "kmeans_iters": (1, 100), "refine_iters": (0, 100), "seed": (0, (1 << 31) - 1)}
    tokens_per_cluster: int = 16
    block: int = 8192  # W
    slack: float = 0.5  # alpha = slack * W
    local: int = 32  # L: unclustered tail of L to 2L tokens, re-clustered every L steps
    sinks: int = 4
    kmeans_iters: int = 10
    refine_iters: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("tokens_per_cluster", "block", "local", "kmeans_iters"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.sinks < 0 or self.refine_iters < 0 or not 0.0 <= self.slack <= 1.0:
            raise ValueError(f"sinks={self.sinks} and refine_iters={self.refine_iters} must be "
                             f">= 0, slack={self.slack} in [0, 1]")


def cluster_stats(k: torch.Tensor, v: torch.Tensor, assign: torch.Tensor, c: int):
    """Member means and sizes: k, v [B, n, D], assign [B, n] -> (Kc, Vc [B, C, D], N [B, C])."""
    b, _, d = k.shape
    idx = assign.long()[..., None].expand(-1, -1, d)
    counts = torch.zeros(b, c).scatter_add_(1, assign.long(), torch.ones(assign.shape))
    kc = torch.zeros(b, c, d).scatter_add_(1, idx, k.float()) / counts.clamp_min(1)[..., None]
    vc = torch.zeros(b, c, d).scatter_add_(1, idx, v.float()) / counts.clamp_min(1)[..., None]
    return kc, vc, counts


class Multipole(SparseMethod):
    name = "multipole"
    Params = MultipoleParams
    caps = Capabilities(streaming=True, estimator=True)

    def _blocks(self, start: int, end: int) -> list[tuple[int, int]]:
        p: MultipoleParams = self.params
        out, s = [], start
        while end - s > p.block * (1 + p.slack):
            out.append((s, s + p.block))
            s += p.block
        return out + ([(s, end)] if end > s else [])

    def _cluster(self, k: torch.Tensor, v: torch.Tensor, seed: int):
        """Cluster one block from scratch: k, v [Hkv, n, D] -> (Kc, Vc, N, assign)."""
        c = math.ceil(k.shape[1] / self.params.tokens_per_cluster)
        _, assign = kmeans(k.float(), c, self.params.kmeans_iters, cosine=False, seed=seed)
        return (*cluster_stats(k, v, assign, c), assign)

    def build_work(self, n_tokens: int, n_heads: int, n_kv_heads: int) -> float:
        p: MultipoleParams = self.params  # blocks of at most (1 + slack) W tokens, clustered apart
        block = min(n_tokens, p.block * (1 + p.slack))
        return n_kv_heads * n_tokens * math.ceil(block / p.tokens_per_cluster) * (p.kmeans_iters + 1.0)

    def build(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Tables:
        p: MultipoleParams = self.params
        hkv, n, d = k.shape
        c_start = min(p.sinks, n)
        c_end = max(c_start, n - p.local)
        parts, first = [], 0
        for s, e in self._blocks(c_start, c_end):
            kc, vc, cnt, assign = self._cluster(k[:, s:e], v[:, s:e], p.seed + s)
            parts.append((kc, vc, cnt, assign + first, s, first))
            first += kc.shape[1]
        if not parts:
            parts = [(torch.zeros(hkv, 0, d), torch.zeros(hkv, 0, d), torch.zeros(hkv, 0),
                      torch.zeros(hkv, 0, dtype=torch.long), c_start, 0)]
        return {
            "centroids": torch.cat([x[0] for x in parts], 1).half(),  # [Hkv, C, D]
            "vcentroids": torch.cat([x[1] for x in parts], 1).half(),  # [Hkv, C, D]
            "counts": torch.cat([x[2] for x in parts], 1).int(),  # [Hkv, C]
            "assign": torch.cat([x[3] for x in parts], 1).int(),  # [Hkv, c_end - c_start]
            # c_start, c_end, first position and first cluster id of the final block
            "span": torch.tensor([c_start, c_end, parts[-1][4], parts[-1][5]]),
        }

    def _state(self, state: LayerState) -> dict:
        if "clusters" not in state.extra:
            t = state.tables
            state.extra["clusters"] = {
                "kc": t["centroids"].float(), "vc": t["vcentroids"].float(),
                "n": t["counts"].float(), "assign": t["assign"].long(),
                "span": [int(x) for x in t["span"]]}
        return state.extra["clusters"]

    def _update(self, cl: dict, keys: torch.Tensor, values: torch.Tensor, n: int) -> None:
        """Move the oldest `local` unclustered tokens into the final block while the tail >= 2L."""
        p: MultipoleParams = self.params
        c_start, c_end, f_start, f_c0 = cl["span"]
        while n - c_end >= 2 * p.local:
            c_end += p.local
            k, v = keys[:, f_start:c_end].float(), values[:, f_start:c_end].float()
            old = cl["kc"][:, f_c0:]
            if c_end - f_start > p.block * (1 + p.slack) or old.shape[1] == 0:
                blocks = self._blocks(f_start, c_end)
            else:
                blocks = []
                new = math.ceil(p.local / p.tokens_per_cluster)
                gen = torch.Generator().manual_seed(p.seed + c_end)
                seeds = k[:, -p.local:][:, torch.randperm(p.local, generator=gen, device="cpu")[:new].to(k.device)]
                assign = lloyd(k, torch.cat([old, seeds], 1), p.refine_iters)
                stats = cluster_stats(k, v, assign, old.shape[1] + new)
                parts = [(*stats, assign, f_start)]
            if blocks:
                parts = [(*self._cluster(keys[:, s:e], values[:, s:e], p.seed + s), s) for s, e in blocks]
            kc, vc, cnt, asg = [cl["kc"][:, :f_c0]], [cl["vc"][:, :f_c0]], [cl["n"][:, :f_c0]], \
                [cl["assign"][:, :f_start - c_start]]
            first = f_c0
            for pk, pv, pn, pa, s in parts:
                kc.append(pk), vc.append(pv), cnt.append(pn), asg.append(pa + first)
                f_start, f_c0, first = s, first, first + pk.shape[1]
            cl.update(kc=torch.cat(kc, 1), vc=torch.cat(vc, 1), n=torch.cat(cnt, 1),
                      assign=torch.cat(asg, 1), span=[c_start, c_end, f_start, f_c0])

    def _importance(self, cl: dict, qg: torch.Tensor, n_eff: torch.Tensor):
        """Eq. 1 averaged over the group -> (importance [Hkv, C], logits [Hkv, G, C], log N)."""
        lc = torch.einsum("hgd,hcd->hgc", qg, cl["kc"]) * qg.shape[-1] ** -0.5
        log_n = n_eff.clamp_min(1e-30).log().masked_fill(n_eff <= 0, float("-inf"))
        importance = (lc - torch.logsumexp(lc + log_n[:, None], -1, keepdim=True)).exp().mean(1)
        return importance.masked_fill(n_eff <= 0, -1.0), lc, log_n

    def search(self, state: LayerState, q: torch.Tensor, keys: torch.Tensor, lo: int, hi: int,
               k: int) -> torch.Tensor:
        """A plain top-k selection (recall metrics): whole clusters in Eq. 1 order, the last cut,
        unclustered keys last; the estimator is `attend`."""
        cl = self._state(state)
        c_start, c_end = cl["span"][:2]
        hkv, n = keys.shape[0], keys.shape[1]
        importance, _, _ = self._importance(cl, q.float().view(hkv, -1, q.shape[-1]), cl["n"])
        score = torch.full((hkv, n), -2.0)
        score[:, c_start:c_end] = torch.gather(importance, 1, cl["assign"])
        order = torch.argsort(score, dim=-1, descending=True, stable=True)
        rank = torch.empty_like(order).scatter_(1, order, torch.arange(n).expand_as(order))
        return topk_in_region(-rank.float(), lo, hi, k)

    def attend(self, state: LayerState, q: torch.Tensor, keys: torch.Tensor,
               values: torch.Tensor, n: int, budget: Budget) -> tuple[torch.Tensor, torch.Tensor]:
        cl = self._state(state)
        self._update(cl, keys, values, n)
        c_start, c_end = cl["span"][:2]
        hkv, d = keys.shape[0], keys.shape[-1]
        lo, hi = budget.region(n)
        static = torch.ones(n, dtype=torch.bool)
        static[lo:hi] = False
        exact_static = static.clone()
        exact_static[:c_start] = True
        exact_static[c_end:] = True
        # keys of the step's static set leave their cluster for this step
        assign = cl["assign"]  # [Hkv, c_end - c_start]
        n_eff = cl["n"] - torch.zeros_like(cl["n"]).scatter_add_(
            1, assign, static[c_start:c_end].float().expand_as(assign).contiguous())
        budget_left = max(0, budget.top_k(n) - int((exact_static & ~static).sum()))
        qg = q.float().view(hkv, -1, d)
        importance, lc, log_n = self._importance(cl, qg, n_eff)  # lc [Hkv, G, C]
        order = importance.argsort(-1, descending=True)
        fits = torch.gather(n_eff, 1, order).cumsum(-1) <= budget_left
        chosen = torch.zeros_like(fits).scatter_(1, order, fits) & (n_eff > 0)  # [Hkv, C]
        exact = exact_static.expand(hkv, n).clone()
        exact[:, c_start:c_end] |= torch.gather(chosen, 1, assign)
        lk = torch.einsum("hgd,hnd->hgn", qg, keys[:, :n].float()) * d ** -0.5
        lk = lk.masked_fill(~exact[:, None], float("-inf"))
        la = (lc + log_n[:, None]).masked_fill(chosen[:, None], float("-inf"))
        probs = torch.cat([lk, la], -1).softmax(-1)
        out = torch.einsum("hgn,hnd->hgd", probs[..., :n], values[:, :n].float()) + \
            torch.einsum("hgc,hcd->hgd", probs[..., n:], cl["vc"])
        return out.reshape(q.shape).to(q.dtype), padded_indices(exact)
