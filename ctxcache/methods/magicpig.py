"""MagicPIG: LSH sampling + self-normalised importance sampling (shared/papers/magicpig.txt).

Offline, per (layer, KV head): centre the keys (k - mean over the prefill keys, Sec. 4.3) and
hash them with SimHash, K sign bits x L tables, one random projector shared by every head and
layer (as in the paper's system, regenerated from `seed` so it is not stored). Online: hash the
query the same way; a key is sampled when it collides with the query in >= `min_collisions`
tables; its sampling probability is Eq. 10,
    u_i = 1 - (1 - p^K)^L - L p^K (1 - p^K)^(L-1),  p = 1 - arccos(cos(q, k_i - mean)) / pi,
and the output is Eq. 11: softmax(q.k / sqrt(d) - log u) over the sampled keys plus the static
keys (sinks, recent window) at u = 1. `attend` is overridden (caps.estimator); the budget's
keep ratio is ignored: (K, L) alone set how many keys are read (Table 8 of the paper).

Choices where the paper is silent or differs from this system:
- GQA: each query head samples and estimates on its own (u_i is that head's probability, so
  the estimator stays the paper's); the keys read from memory are the union over the group,
  which is what `attend` returns as the indices it read ([Hkv, K'], short rows padded
  by repeating an index).
- RoPE: hashing works on post-RoPE Q/K; the query is hashed uncentred, the keys centred
  (softmax is translation invariant, so logits use the raw keys).
- The Eq. 8 MIPS transform is not used (the paper's own experiments do not use it either).
- Generated keys are hashed in `append` with the prefill mean, so they become sampleable once
  they leave the recent window. Dense layers: the decoder's SparseConfig.dense_layers (the
  paper keeps layers {0, 16} of Llama dense).
- Cost here is the torch reference: collision counts scan all codes (O(n L) compares); a
  bucketed hash table is the fast path and gives the same sample set.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from ctxcache.methods.base import Capabilities, LayerState, MethodParams, SparseMethod, Tables
from ctxcache.methods.budget import Budget, topk_in_region

PAPER_CONFIGS = ((8, 75), (9, 120), (10, 150))  # (K, L) compared in the CTkvr paper, App. B.2
PAPER_TABLE8 = {(8, 75): 0.05, (9, 120): 0.04, (10, 150): 0.02}  # measured budget, Table 8


@dataclass(frozen=True)
class MagicPIGParams(MethodParams):
    BOUNDS: ClassVar[dict[str, tuple[float, float]]] = {
        "bits": (1, 15), "tables": (1, 1024), "min_collisions": (1, 2), "seed": (0, (1 << 31) - 1)}
    bits: int = 9  # K: sign bits per table
    tables: int = 120  # L: hash tables
    min_collisions: int = 2  # a key is sampled when it collides in at least this many tables
    center: bool = True  # hash k - mean(k) (the paper's centering)
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.bits <= 15:
            raise ValueError(f"bits={self.bits} must be in [1, 15] (codes are stored as int16)")
        if self.tables < 1:
            raise ValueError(f"tables={self.tables} must be >= 1")
        if self.min_collisions not in (1, 2) or self.min_collisions > self.tables:
            raise ValueError(f"min_collisions={self.min_collisions} must be 1 or 2 (Eq. 10) and "
                             f"<= tables={self.tables}")


def sampling_probability(cos: torch.Tensor, bits: int, tables: int, min_collisions: int = 2) -> torch.Tensor:
    """u = P[collide in >= min_collisions of L tables] for cosine `cos` (Eq. 10), float64."""
    p = 1.0 - torch.arccos(cos.double().clamp(-1.0, 1.0)) / math.pi
    x = p.pow(bits)  # collision probability in one table
    none = torch.exp(tables * torch.log1p(-x.clamp(max=1 - 1e-15)))
    u = 1.0 - none
    if min_collisions == 2:
        u = u - tables * x * torch.exp((tables - 1) * torch.log1p(-x.clamp(max=1 - 1e-15)))
    return u.clamp_min(1e-300)


def is_estimate(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, use: torch.Tensor,
                log_u: torch.Tensor) -> torch.Tensor:
    """Self-normalised IS estimate (Eq. 11). q [Hkv, G, D]; keys, values [Hkv, n, D];
    use [Hkv, G, n] bool (sampled or static); log_u [Hkv, G, n] -> [Hkv, G, D]."""
    d = q.shape[-1]
    logits = torch.einsum("hgd,hnd->hgn", q.float(), keys.float()) * d ** -0.5 - log_u
    probs = logits.masked_fill(~use, float("-inf")).softmax(-1)
    return torch.einsum("hgn,hnd->hgd", probs, values.float())


def padded_indices(mask: torch.Tensor) -> torch.Tensor:
    """mask [Hkv, n] bool -> the True positions [Hkv, max count], ascending; a row with fewer
    is padded by repeating its last position (safe to gather or scatter; count distinct
    indices per row for the keys really read)."""
    count = max(1, int(mask.sum(-1).max())) if mask.numel() else 0
    pos = torch.arange(mask.shape[-1], device=mask.device)
    key = torch.where(mask, pos, -1)
    idx = key.sort(-1, descending=True).values[:, :count].flip(-1)  # ascending, -1 first
    last = idx[:, -1:].clamp_min(0)
    return torch.where(idx >= 0, idx, last)


class MagicPIG(SparseMethod):
    name = "magicpig"
    Params = MagicPIGParams
    caps = Capabilities(streaming=True, estimator=True)

    def projector(self, head_dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Random hyperplanes [D, K*L], the same for every head and layer."""
        p: MagicPIGParams = self.params
        cache = self.__dict__.setdefault("_projectors", {})
        key = (head_dim, str(device))
        if key not in cache:
            gen = torch.Generator().manual_seed(p.seed)
            cache[key] = torch.randn(head_dim, p.bits * p.tables, generator=gen, device="cpu").to(device)
        return cache[key]

    def hash(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] -> codes [..., L] int16 (K sign bits packed per table)."""
        p: MagicPIGParams = self.params
        signs = (x.float() @ self.projector(x.shape[-1], x.device) > 0).unflatten(-1, (p.tables, p.bits))
        weights = 2 ** torch.arange(p.bits, device=x.device)
        return (signs.long() * weights).sum(-1).to(torch.int16)

    def build(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Tables:
        mean = k.float().mean(1) if self.params.center else torch.zeros(k.shape[0], k.shape[2])
        return {"key_mean": mean, "codes": self.hash(k.float() - mean[:, None])}  # [Hkv, D], [Hkv, N, L]

    def append(self, state: LayerState, k_new: torch.Tensor, start: int) -> None:
        codes = self.hash(k_new.float() - state.tables["key_mean"][:, None].to(k_new.device))
        old = state.extra.get("codes")
        state.extra["codes"] = codes if old is None else torch.cat([old, codes], dim=1)
        state.extra.setdefault("codes_start", start)

    def _codes(self, state: LayerState, n: int) -> torch.Tensor:
        """Codes of the first n keys [Hkv, n, L] (prefill codes + appended ones)."""
        base = state.tables["codes"]
        new = state.extra.get("codes")
        if new is not None and base.shape[1] < n:
            start = state.extra["codes_start"]
            base = torch.cat([base[:, :start], new], dim=1)
        return base[:, :n]

    def collisions(self, state: LayerState, qcodes: torch.Tensor, n: int) -> torch.Tensor:
        """Tables in which each of the first n keys shares the query's code: qcodes [Hkv, G, L]
        -> [Hkv, G, n] int. Prefill keys through hash buckets (keys sorted by code per table,
        built once per stream), so the cost follows the collisions, not n * L."""
        base = state.tables["codes"]
        if "bucket_order" not in state.extra:
            sorted_codes, order = base.transpose(1, 2).long().sort(-1)  # [Hkv, L, N]
            state.extra["bucket_codes"], state.extra["bucket_order"] = sorted_codes.contiguous(), order
        sorted_codes, order = state.extra["bucket_codes"], state.extra["bucket_order"]
        hkv, g, tables = qcodes.shape
        n_base = min(n, state.extra.get("codes_start", base.shape[1]), base.shape[1])
        want = qcodes.long().permute(0, 2, 1).contiguous()  # [Hkv, L, G]
        start = torch.searchsorted(sorted_codes, want)
        count = torch.searchsorted(sorted_codes, want, right=True) - start
        # flat positions of every colliding (head, table, group member, key) in order
        lens = count.flatten()
        first = (start + torch.arange(hkv * tables).view(hkv, tables, 1) * base.shape[1]).flatten()
        offs = torch.arange(int(lens.sum())) - torch.repeat_interleave(lens.cumsum(0) - lens, lens)
        keys = order.flatten()[torch.repeat_interleave(first, lens) + offs]
        row = torch.repeat_interleave(torch.arange(hkv)[:, None, None] * g + torch.arange(g)[None, None],
                                      1, 0).expand(hkv, tables, g).flatten()
        row = torch.repeat_interleave(row, lens)
        hits = torch.zeros(hkv * g * n, dtype=torch.long)
        keep = keys < n_base
        hits.scatter_add_(0, row[keep] * n + keys[keep], torch.ones_like(keys[keep]))
        hits = hits.view(hkv, g, n)
        if n > n_base:  # keys appended during decode: compare directly (few)
            hits[..., n_base:] = (self._codes(state, n)[:, None, n_base:] == qcodes[:, :, None]).sum(-1)
        return hits

    def sample(self, state: LayerState, q: torch.Tensor, keys: torch.Tensor, n: int,
               lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (sampled [Hkv, G, n] bool inside [lo, hi), log u [Hkv, G, n])."""
        p: MagicPIGParams = self.params
        hkv, d = keys.shape[0], keys.shape[-1]
        qg = q.float().view(hkv, -1, d)
        hits = self.collisions(state, self.hash(qg), n)  # [Hkv, G, n]
        region = torch.zeros(n, dtype=torch.bool, device=q.device)
        region[lo:hi] = True
        sampled = (hits >= p.min_collisions) & region
        centred = keys[:, :n].float() - state.tables["key_mean"][:, None].to(keys.device)
        cos = torch.einsum("hgd,hnd->hgn", F.normalize(qg, dim=-1), F.normalize(centred, dim=-1))
        log_u = sampling_probability(cos, p.bits, p.tables, p.min_collisions).log().float()
        return sampled, log_u

    def search(self, state: LayerState, q: torch.Tensor, keys: torch.Tensor, lo: int, hi: int,
               k: int) -> torch.Tensor:
        """A plain top-k selection for callers that need one (recall metrics): keys ranked by
        their table collisions summed over the group; not the paper's estimator."""
        hkv, n = keys.shape[0], keys.shape[1]
        hits = self.collisions(state, self.hash(q.float().view(hkv, -1, q.shape[-1])), n)
        return topk_in_region(hits.sum(1).float(), lo, hi, k)

    def attend(self, state: LayerState, q: torch.Tensor, keys: torch.Tensor,
               values: torch.Tensor, n: int, budget: Budget) -> tuple[torch.Tensor, torch.Tensor]:
        lo, hi = budget.region(n)
        sampled, log_u = self.sample(state, q, keys, n, lo, hi)
        static = torch.ones(n, dtype=torch.bool, device=q.device)
        static[lo:hi] = False
        use = sampled | static
        # no static window and nothing sampled: read the newest key rather than return NaN
        use[..., n - 1] |= ~use.any(-1)
        log_u = torch.where(static, torch.zeros_like(log_u), log_u)  # static keys at u = 1
        out = is_estimate(q.view(keys.shape[0], -1, q.shape[-1]), keys[:, :n], values[:, :n], use, log_u)
        stats = state.extra.setdefault("sampled_stats", [0, 0])
        stats[0] += int(sampled.sum())
        stats[1] += sampled.shape[0] * sampled.shape[1] * max(hi - lo, 0)
        return out.reshape(q.shape).to(q.dtype), padded_indices(use.any(1))


def sampled_fraction(states: list[LayerState]) -> float:
    """Mean fraction of the searched region sampled per query head, over the given states."""
    got = sum(s.extra.get("sampled_stats", [0, 0])[0] for s in states)
    total = sum(s.extra.get("sampled_stats", [0, 0])[1] for s in states)
    return got / total if total else float("nan")
