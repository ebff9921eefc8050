"""CTkvr: centroid-then-token retrieval via a query-centroid inverted file (ctkvr.txt, Sec. 3.1).

Offline, per (layer, KV head): the last prefill queries of the KV head's query group are the
centroids (Obs. 1: adjacent post-RoPE queries are similar); each centroid keeps the ids of its
top-k keys by exact q.k (the qcIVF). Online (Algorithm 2): Recall, cosine of the decode query
with every centroid, top-r centroids, their lists deduplicated; Rerank, exact q.k on the
recalled keys only, keep the top-B. Dynamic centroid update (Sec. 3.1.3): after each search the
current queries become centroids whose lists are this step's reranked keys; the qcIVF keeps
`centroids` entries first-in first-out (the oldest prefill centroids leave first).

Choices where the paper (whose symbols were lost in our copy) is unclear:
- GQA: the qcIVF is per KV head (as in the paper); its centroids are (position, query head)
  pairs of the last ceil(centroids / G) positions of the G heads. At decode a centroid's cosine
  is its best over the group's G queries; the rerank score of a key is the sum over the group of
  softmax(q.k / sqrt(d)) over the recalled set, so the selection is shared by the group.
- Lists are over all prefill keys; keys outside the searched region [lo, hi) are dropped at
  decode. Keys generated after the prefill are always recalled (no list holds them).
- When recall yields fewer than B keys in the region, the most recent unrecalled keys fill the
  selection so that every step reads exactly B keys like the other methods.
- Per-stream state (the FIFO of dynamic centroids) lives in LayerState.extra; the shared tables
  are never written. RoPE: post-RoPE Q/K as the paper. Dense layers: SparseConfig.dense_layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from ctxcache.methods.base import Capabilities, LayerState, MethodParams, SparseMethod, Tables


@dataclass(frozen=True)
class CTkvrParams(MethodParams):
    BOUNDS: ClassVar[dict[str, tuple[float, float]]] = {
        "centroids": (1, 8192), "keys_per_centroid": (1, 1 << 16), "recall": (1, 1024)}
    centroids: int = 640  # qcIVF entries per KV head (paper: accuracy plateaus near 320 to 640)
    keys_per_centroid: int = 256  # top-k keys stored per centroid
    recall: int = 8  # r: centroids recalled per step (paper: plateau from about 5)
    dynamic_update: bool = True  # FIFO centroid update during decode

    def __post_init__(self) -> None:
        for name in ("centroids", "keys_per_centroid", "recall"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")


class CTkvr(SparseMethod):
    name = "ctkvr"
    Params = CTkvrParams
    caps = Capabilities(uses_queries=True, streaming=True)

    def build(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Tables:
        p: CTkvrParams = self.params
        hkv, n, d = k.shape
        g = q.shape[0] // hkv
        # the newest queries: q may be a sample of the prefill's (capture_queries, the stored
        # query sample), which always ends with the newest positions
        positions = min(q.shape[1], math.ceil(p.centroids / g))
        # [Hkv, G, P, D] -> [Hkv, P*G, D], oldest position first (the FIFO order)
        cent = q[:, -positions:].float().view(hkv, g, positions, d).transpose(1, 2).reshape(hkv, -1, d)
        cent = cent[:, -p.centroids:]
        scores = torch.einsum("hcd,hnd->hcn", cent, k.float())
        lists = torch.topk(scores, min(p.keys_per_centroid, n), dim=-1).indices
        return {"centroids": cent.half(), "lists": lists.int()}  # [Hkv, C, D], [Hkv, C, k]

    def append(self, state: LayerState, k_new: torch.Tensor, start: int) -> None:
        state.extra.setdefault("gen_start", start)

    def _ivf(self, state: LayerState) -> tuple[torch.Tensor, torch.Tensor]:
        """The current qcIVF: (centroids [Hkv, C', D] float, lists [Hkv, C', k] long, -1 = none)."""
        cent, lists = state.tables["centroids"].float(), state.tables["lists"].long()
        dyn = state.extra.get("dyn_cent")
        if dyn is None:
            return cent, lists
        keep = max(0, cent.shape[1] - dyn.shape[1])  # FIFO: the oldest prefill entries leave first
        return (torch.cat([cent[:, cent.shape[1] - keep:], dyn], 1),
                torch.cat([lists[:, lists.shape[1] - keep:], state.extra["dyn_lists"]], 1))

    def recall_mask(self, state: LayerState, q: torch.Tensor, n: int, lo: int, hi: int) -> torch.Tensor:
        """Recall stage: [Hkv, n] bool of the deduplicated keys of the top-r centroids, in [lo, hi)."""
        cent, lists = self._ivf(state)
        hkv = cent.shape[0]
        qn = F.normalize(q.float().view(hkv, -1, q.shape[-1]), dim=-1)
        cos = torch.einsum("hgd,hcd->hgc", qn, F.normalize(cent, dim=-1)).amax(1)  # [Hkv, C']
        top = torch.topk(cos, min(self.params.recall, cos.shape[1]), dim=-1).indices
        ids = torch.gather(lists, 1, top[..., None].expand(-1, -1, lists.shape[2])).flatten(1)
        mask = torch.zeros(hkv, n + 1, dtype=torch.bool, device=q.device)
        mask.scatter_(1, torch.where(ids >= 0, ids.clamp(max=n - 1), n), True)  # -1 -> dropped slot
        mask = mask[:, :n]
        mask[:, state.extra.get("gen_start", n):] = True
        mask[:, :lo] = False
        mask[:, hi:] = False
        return mask

    def search(self, state: LayerState, q: torch.Tensor, keys: torch.Tensor, lo: int, hi: int,
               k: int) -> torch.Tensor:
        n, hkv, d = keys.shape[1], keys.shape[0], keys.shape[-1]
        k = min(k, hi - lo)
        mask = self.recall_mask(state, q, n, lo, hi)
        width = min(max(int(mask.sum(-1).max()), k), hi - lo)
        pos = torch.arange(n, device=q.device, dtype=torch.float)
        # recalled keys first, then the most recent others (the fill), never outside [lo, hi)
        order = torch.where(mask, 2.0 * n + pos, pos)
        order[:, :lo] = -1.0
        order[:, hi:] = -1.0
        cand = torch.topk(order, width, dim=-1).indices  # [Hkv, W]
        recalled = torch.gather(mask, 1, cand)
        ks = torch.gather(keys, 1, cand[..., None].expand(-1, -1, d)).float()
        logits = torch.einsum("hgd,hwd->hgw", q.float().view(hkv, -1, d), ks) * d ** -0.5
        probs = logits.masked_fill(~recalled[:, None], float("-inf")).softmax(-1).nan_to_num(0.0).sum(1)
        score = torch.where(recalled, probs, -2.0 + torch.gather(pos, 0, cand.flatten()).view_as(cand) / n)
        best = torch.topk(score, k, dim=-1)
        chosen = torch.gather(cand, 1, best.indices)
        if self.params.dynamic_update:
            self._update(state, q, chosen, torch.gather(recalled, 1, best.indices))
        return chosen

    def _update(self, state: LayerState, q: torch.Tensor, chosen: torch.Tensor, real: torch.Tensor) -> None:
        """Push the group's queries with this step's reranked keys into the FIFO qcIVF."""
        p: CTkvrParams = self.params
        hkv = chosen.shape[0]
        width = state.tables["lists"].shape[2]
        lst = torch.where(real, chosen, torch.full_like(chosen, -1))[:, :width]
        lst = F.pad(lst, (0, width - lst.shape[1]), value=-1)
        g = q.shape[0] // hkv
        new_c = q.float().view(hkv, g, -1)
        new_l = lst[:, None].expand(-1, g, -1)
        old_c, old_l = state.extra.get("dyn_cent"), state.extra.get("dyn_lists")
        if old_c is not None:
            new_c, new_l = torch.cat([old_c, new_c], 1), torch.cat([old_l, new_l], 1)
        cap = state.tables["centroids"].shape[1]
        state.extra["dyn_cent"], state.extra["dyn_lists"] = new_c[:, -cap:], new_l[:, -cap:]
