"""CSAttention: query-centric per-subspace centroid tables (see shared/papers/csattention.txt).

Offline, per (layer, KV head): split the head dimension into m subspaces, cluster the GQA
group's prefill queries per subspace with cosine k-means (C centroids), score every centroid
against every key in that subspace and keep the Top-L (index, score) pairs per centroid.
Online: per subspace pick the nearest centroid of the query, gather the m lists, sum scores
by key index into a dense accumulator, take Top-K in the middle region.

Departures from the paper, each chosen by measurement (bench/README.md) and switchable here:
- `weighting="qnorm"`: list scores scaled by the query's subspace norm (c . k estimates q . k / ||q_b||).
- `scoring="expected"` (default): a listed key contributes s - mean(unlisted scores of that list),
  an absent key 0. `absolute` (the paper: raw scores) ranks absent keys above negative listed
  ones; `relative` (s - the L-th score) is 0.04 worse in mass recall.
- `list_fraction=1.0` (default): full-length lists, stored densely in key order as
  `dense_score` [Hkv, m, C, N] with no indices: the estimate is the weighted sum of m rows, the
  only variant above 0.90 mass recall on both SmolLM2 texts (4x the KV bytes as int8; paper: 6x).
- GQA, `routing="group"` (default): the group shares one selection (one KV read) ranked by its
  summed logits, sum_g q_g . k = (sum_g q_g) . k: the tables cluster the group-sum queries and a
  step routes the sum once, reading m rows per KV head instead of G * m (4x fewer at Llama-3.1-8B
  shapes). SmolLM2 4K, keep 5%: mass recall 0.932 / 0.919 (prose / code) vs 0.940 / 0.925
  routing each head (`routing="head"`, merged by `group_combine`).
- int8 dense tables (`table_dtype="auto"`, the default for the dense layout): int8 rows with a
  per-row scale (half the bytes), an integer dot product against int8-quantized routed weights
  (methods/int8_tables; the GPU's dp4a is bitwise equal); mass recall as fp16 tables.
- `rerank=4` (default): the estimate proposes ceil(rerank * K) candidates and exact attention over
  their keys picks the K (`exact_rerank`, the oracle's group criterion): the estimate alone dropped
  a number's last digit the oracle kept (bench compare, SmolLM2, keep 5%). rerank 2: 3 W / 8 L
  against 4 on the wide suite; rerank 3: 0.987 / 0.967 of full's right answers on seeds 0 / 1 against
  4's 0.987 / 0.977 (compare_rerank_*_cpu). Candidates count as read (`search_reads`); on the GPU
  `kernels/rerank.Reranker` re-ranks them in the captured step.
- `follow=128` (default; with a re-rank): each step the successors of the previous step's 128 best
  re-ranked keys per KV head (the prompt's last query seeds the first) take candidate slots ahead of
  the estimate's: a head copying a number attends one key further each step, a key the estimate
  ranked 461-1486 against a cut of 412. follow=128 keeps 0.987 vs the oracle's 0.982 (follow=0:
  0.951; bench/README.md). The GPU path does the same (kernels/follow.py).
- `reselect=2` (default; 1: the estimate every step): every other step attends the last selection,
  its best keys' successors and the new key (all of them: `attend_reads`) instead of the estimate's
  candidates and re-ranks them for the next (csattention_refs, kernels/carry.py, carried_attention.py;
  DESIGN.md: its answers and GPU times).
- Streaming inserts do not evict: a generated key is recorded against every centroid whose
  list floor it beats (the paper's try-insert condition) in a per-stream overlay, so the
  shared tables stay read-only while many streams decode from one artifact.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F

from ctxcache.host_copy import to_host, wait_for_host_copies
from ctxcache.methods.base import Capabilities, LayerState, MethodParams, ParamError, SparseMethod, Tables
from ctxcache.methods.budget import fp16_rank, outside_region, topk_in_region
from ctxcache.methods.csattention_lean import lean_state
from ctxcache.methods.csattention_params import CSAttentionParams
from ctxcache.methods.csattention_refs import (carried_candidates, exact_rerank, promote_successors,
                                               subspace_permutation)
from ctxcache.methods.csattention_rows import DERIVED, ROW_KEYS, dense_row_bytes, dense_rows, routed_rows, row_keys
from ctxcache.methods.int8_tables import int_dot_scores
from ctxcache.methods.kmeans import kmeans
from ctxcache.methods.oracle import group_probabilities

GPU_LAYER_GROUP = 8  # layers clustered together on a GPU (their seed draws share launches)


class CSAttention(SparseMethod):
    name = "csattention"
    Params = CSAttentionParams
    caps = Capabilities(uses_queries=True, streaming=True, gpu_decode=True)
    search_params = frozenset({"rerank", "follow", "reselect"})

    def check_model(self, head_dim: int) -> None:
        try:
            subspace_permutation(head_dim, self.params.subspaces, self.params.layout)
        except ValueError as exc:
            raise ParamError("subspaces", str(exc)) from exc

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        """[..., D] -> [..., m, D/m] in subspace order."""
        p: CSAttentionParams = self.params
        perm = subspace_permutation(x.shape[-1], p.subspaces, p.layout).to(x.device)
        return x[..., perm].unflatten(-1, (p.subspaces, -1))

    def build(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Tables:
        p: CSAttentionParams = self.params
        cent = self._cluster_queries(q, k.shape[0])  # [Hkv, m, C, d_b]
        sub_k = self._split(k.float()).permute(0, 2, 1, 3)  # [Hkv, m, N, d_b]
        n = k.shape[1]
        if p.list_length(n) == n:
            # Full lists: every key is in every list, so the scores sit in key order with no
            # indices; the reduce-by-key becomes a weighted sum of m rows. The rows are what
            # restore derives at load (the same function), so built and loaded tables agree.
            return dense_rows(cent.half(), sub_k, p.int8_tables)
        scores = torch.einsum("hmcd,hmnd->hmcn", cent, sub_k)  # centroid-scores
        top = torch.topk(scores, p.list_length(n), dim=-1)
        absent_mean = (scores.sum(-1) - top.values.sum(-1)) / max(n - top.values.shape[-1], 1)
        return {
            "centroids": cent.half(),
            "list_idx": top.indices.int(),  # [Hkv, m, C, L]
            "list_score": top.values.half(),  # [Hkv, m, C, L], descending
            "list_floor": top.values[..., -1].half(),  # [Hkv, m, C]: the L-th score
            "list_absent_mean": absent_mean.half(),  # [Hkv, m, C]: mean score of unlisted keys
        }

    def build_layers(self, layers: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                     n_layers: int) -> Iterator[Tables]:
        """On a GPU (keys on CUDA, contiguous subspaces): GPU_LAYER_GROUP layers per batched
        k-means on the keys' device (methods/csattention_build: a fraction of the prefill);
        otherwise the CPU build, layer by layer."""
        layers = iter(layers)
        first = next(layers, None)
        if first is None:
            return
        layers = itertools.chain([first], layers)
        if not (first[1].is_cuda and self.params.layout == "contiguous"):
            yield from super().build_layers(layers, n_layers)
            return
        from ctxcache.methods.csattention_build import build_tables_gpu_layers  # Triton only where a GPU is
        device = first[1].device
        while group := list(itertools.islice(layers, GPU_LAYER_GROUP)):
            qs = [q.to(device) for q, _, _ in group]
            built = [{name: to_host(t) for name, t in self.persist(tables).items()}
                     for tables in build_tables_gpu_layers(self.params, qs, [k for _, k, _ in group], rows=False)]
            wait_for_host_copies(device)  # once per group: the copies overlap, the caller reads landed tables
            yield from built

    def build_work(self, n_tokens: int, n_heads: int, n_kv_heads: int) -> float:
        p: CSAttentionParams = self.params
        points = n_tokens * (1 if p.routing == "group" else n_heads // n_kv_heads)
        points = min(points, p.max_queries or points)
        return n_kv_heads * p.subspaces * points * p.centroids * (p.kmeans_iters + 1.0)

    def _cluster_queries(self, q: torch.Tensor, hkv: int) -> torch.Tensor:
        """Cosine k-means per (KV head, subspace) over the GQA group's queries -> [Hkv, m, C, d_b]."""
        p: CSAttentionParams = self.params
        group_q = self._group(q.float().unflatten(0, (hkv, -1))).flatten(1, 2)  # [Hkv, G*N or N, D]
        if p.max_queries is not None and group_q.shape[1] > p.max_queries:
            gen = torch.Generator().manual_seed(p.seed)
            group_q = group_q[:, torch.randperm(group_q.shape[1], generator=gen)[:p.max_queries]]
        sub_q = self._split(group_q).permute(0, 2, 1, 3)  # [Hkv, m, Nq, d_b]
        cent, _ = kmeans(sub_q.flatten(0, 1), p.centroids, p.kmeans_iters, cosine=True,
                         batch_size=p.kmeans_batch, seed=p.seed)
        return cent.view(hkv, p.subspaces, p.centroids, -1)

    def _group(self, q: torch.Tensor) -> torch.Tensor:
        """[Hkv, G, ...] queries -> what routes: each head's own, or the group's sum [Hkv, 1, ...]."""
        return q.sum(1, keepdim=True) if self.params.routing == "group" else q

    def _route(self, cent: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Nearest centroid(s) per subspace for q [Hkv, G, m, d_b] ->
        (centroid ids [Hkv, G, m, tau], weights [Hkv, G, m, tau] summing to 1)."""
        p: CSAttentionParams = self.params
        cos = torch.einsum("hgmd,hmcd->hgmc", F.normalize(q, dim=-1), cent)
        tau = min(p.backoff_tau if p.backoff_cos > -1.0 else 1, cent.shape[2])
        best = torch.topk(cos, tau, dim=-1)
        use = torch.ones_like(best.values)
        if tau > 1:
            low = best.values[..., :1] < p.backoff_cos
            use[..., 1:] = low.float().expand(*use.shape[:-1], tau - 1)
        return best.indices, use / use.sum(-1, keepdim=True)

    @property
    def _dense(self) -> bool:
        return self.params.list_fraction == 1.0

    def persist(self, tables: Tables) -> Tables:
        """The dense layout stores its centroids only: the rows are c . K_b (csattention_rows)."""
        return {n: t for n, t in tables.items() if n not in DERIVED} if self._dense else tables

    def restore(self, tables: Tables, k: torch.Tensor, on_demand: bool = False) -> Tables:
        """Derive the dense rows from the centroids and the keys k [Hkv, N, D] on k's device (GPU:
        a matmul a layer). on_demand: keep the subspace keys, and a step computes its m routed rows
        (the CPU reference: all C rows of 30 layers at 4K took 18-31 s, a step's rows < 1 ms)."""
        if not self._dense or "dense_score" in tables or ROW_KEYS in tables:
            return tables
        # contiguous subspaces: a view (a gather by the identity copied every key at load)
        p: CSAttentionParams = self.params
        split = k.unflatten(-1, (p.subspaces, -1)) if p.layout == "contiguous" else self._split(k)
        sub_k = split.permute(0, 2, 1, 3)  # [Hkv, m, N, d_b]
        if on_demand:
            # fp64 and transposed once here, not per step and layer: converting and relaying
            # the keys each step was a third of a 4K CPU decode step (2x the K bytes resident)
            return {**tables, ROW_KEYS: row_keys(sub_k)}
        return {**tables, **dense_rows(tables["centroids"].to(k.device), sub_k, self.params.int8_tables)}

    def derived_bytes(self, n_tokens: int, n_kv_heads: int) -> int:
        """Bytes per layer that restore adds to the stored tables when it materializes the rows
        (resident on a GPU; the CPU reference computes the routed rows per step instead)."""
        p: CSAttentionParams = self.params
        return dense_row_bytes(n_tokens, n_kv_heads, p.subspaces, p.centroids, p.int8_tables) if self._dense else 0

    def gpu_decodable(self, tables: Tables) -> bool:
        """The fast runner serves the default storage: dense int8 rows (see GpuDenseTables),
        stored (format 1) or derived at load from the centroids (format 2)."""
        return self.params.gpu_selectable and self._dense and self.params.int8_tables and "centroids" in tables

    def search(self, state: LayerState, q: torch.Tensor, keys: torch.Tensor, lo: int, hi: int,
               k: int) -> torch.Tensor:
        c = self.params.candidates(k, hi - lo)
        if c <= k:
            return self._propose(state, q, keys, lo, hi, c, 0)
        follow, ex = self.params.follows, state.extra
        carried = carried_candidates(ex, lo, hi, k) if ex.get("reselect_left", 0) > 0 else None
        ex["reselect_left"] = ex["reselect_left"] - 1 if carried is not None else self.params.reselects - 1
        found, valid = carried if carried is not None else (self._propose(state, q, keys, lo, hi, c, follow), None)
        others = outside_region(lo, hi, keys.shape[1], found.device).expand(found.shape[0], -1)
        chosen = exact_rerank(q, keys, found, k, others, ordered=bool(follow), valid=valid)
        if follow:
            ex["follow_prev"] = chosen[:, :follow]
        if self.params.reselects > 1:
            ex["chosen_prev"], ex["chosen_hi"] = chosen, hi
        return chosen if carried is None else torch.where(valid, found, -1)  # carried: all candidates (-1: none)

    def _propose(self, state: LayerState, q: torch.Tensor, keys: torch.Tensor, lo: int, hi: int,
                 c: int, follow: int) -> torch.Tensor:
        """The estimate's c best keys in [lo, hi), the successors of the last step's best first."""
        est = self.estimate(state, q, n=keys.shape[1])  # [Hkv, G, n]
        # rank fp16-rounded estimates, ties to the lower index: deterministic, and what the GPU
        # selection computes (its radix select runs over 16-bit keys), so both paths agree
        rank = fp16_rank(self._combine(est, q.shape[-1]))
        if follow and "follow_prev" in state.extra:
            rank = promote_successors(rank, state.extra["follow_prev"], lo, hi)
        return topk_in_region(rank, lo, hi, c)

    @property
    def observes_dense(self) -> bool:
        return self.params.follows > 0

    def observe_dense(self, state: LayerState, q: torch.Tensor, keys: torch.Tensor, lo: int, hi: int) -> None:
        """follow: the prompt's last query's `follow` best keys in [lo, hi) by exact attention (fp16 keys,
        ties low, as the GPU's seed_topk) stand in for a previous search: the first step proposes their successors."""
        if not self.params.follows or hi <= lo:
            return
        probs = group_probabilities(q, keys).sum(1)[:, lo:hi]  # [Hkv, hi - lo]
        best = torch.topk(fp16_rank(probs), min(self.params.follow, hi - lo), dim=-1).indices + lo
        state.extra["follow_prev"] = best

    def search_reads(self, k: int, region: int) -> int:
        """The candidates' keys; with reselect, averaged over a selection's steps (at most K +
        follow + 1 candidates on the carried ones, which attend them all: attend_reads)."""
        return self._spans_mean(self.params.candidates(k, region), k, region)

    def attend_reads(self, k: int, region: int) -> int:
        return self._spans_mean(min(k, region), k, region)

    def _spans_mean(self, selecting: int, k: int, region: int) -> int:
        c, spans = self.params.candidates(k, region), self.params.reselects
        if spans == 1 or c <= k:
            return selecting
        return -(-(selecting + (spans - 1) * min(c, k + self.params.follows + 1)) // spans)

    def index_read_bytes(self, n_tokens: int, n_kv_heads: int, group: int) -> int:
        """The routed rows (dense layout: one per subspace and route, per KV head, or per query
        head with routing="head") with their scales; lists: their (int32 index, fp16 score) pairs.
        With reselect the mean over a selection's steps (the carried ones read none)."""
        p: CSAttentionParams = self.params
        routes = p.subspaces * (p.backoff_tau if p.backoff_cos > -1.0 else 1) * (group if p.routing == "head" else 1)
        per_key = (1 if p.int8_tables else 2) if self._dense else 6
        scales = (4 if p.int8_tables else 0) if self._dense else 0
        rows = n_kv_heads * routes * ((n_tokens if self._dense else p.list_length(n_tokens)) * per_key + scales)
        return -(-rows // p.reselects)

    def estimate(self, state: LayerState, q: torch.Tensor, n: int) -> torch.Tensor:
        """Estimated (offset) logits [Hkv, G, n] of every cached key for q [Hq, D] (int8 tables:
        the group's summed estimate in head 0, zeros in the others)."""
        t = state.tables
        if self._lean_applies(t):
            return self._estimate_lean(state, q, n)
        cent = t["centroids"].float()
        hkv, m = cent.shape[:2]
        sub_q = self._split(self._group(q.float().view(hkv, -1, q.shape[-1])))  # [Hkv, G or 1, m, d_b]
        ids, wts = self._route(cent, sub_q)
        wts = wts * self._subspace_weights(sub_q, cent, ids)  # [Hkv, G, m, tau]
        hh = torch.arange(hkv)[:, None, None, None]
        mm = torch.arange(m)[None, None, :, None]
        acc = torch.zeros(hkv, sub_q.shape[1], n)
        if "dense_score" in t or ROW_KEYS in t:
            rows, scale = self._routed_rows(t, hh, mm, ids)  # [Hkv, R, N], [Hkv, R] (int8) or None
            n_rows = rows.shape[-1]
            if scale is not None:  # int8 rows: the integer estimate of the group's sum, in head slot 0
                ws = wts.reshape(hkv, -1) * scale
                acc[:, 0, :n_rows] = int_dot_scores(rows, ws)
            else:
                g = sub_q.shape[1]
                acc[..., :n_rows] = torch.bmm(wts.reshape(hkv * g, 1, -1),
                                              rows.float().view(hkv * g, -1, n_rows)).view(hkv, g, -1)
            floor = torch.full(ids.shape, float("-inf"))  # every appended key is listed too
            self._add_streamed(state, acc, ids, wts, floor, offset=torch.zeros(ids.shape))
            return acc
        idx = t["list_idx"][hh, mm, ids].long()  # [Hkv, G, m, tau, L]
        val = t["list_score"][hh, mm, ids].float()
        floor = t["list_floor"][hh, mm, ids].float()  # [Hkv, G, m, tau]
        offset = self._score_offset(t, hh, mm, ids, floor)
        acc.scatter_add_(2, idx.flatten(2), ((val - offset[..., None]) * wts[..., None]).flatten(2))
        self._add_streamed(state, acc, ids, wts, floor, offset)
        return acc

    def _lean_applies(self, t: Tables) -> bool:
        """The default parameters (group routing, one centroid per subspace, unit or qnorm
        weights, int8 rows): estimate's arithmetic with half the torch calls (_estimate_lean)."""
        p: CSAttentionParams = self.params
        return (p.routing == "group" and p.backoff_cos <= -1.0 and p.weighting in ("unit", "qnorm")
                and p.int8_tables and (ROW_KEYS in t or "dense_scale" in t))

    def _estimate_lean(self, state: LayerState, q: torch.Tensor, n: int) -> torch.Tensor:
        """estimate() for _lean_applies, bitwise its general path's result (its ops less the
        identities), the centroids converted once per stream (csattention_lean.LeanState): at 4K
        the general path's ~60 small torch calls a layer cost more on the CPU than its arithmetic."""
        t, lean = state.tables, lean_state(state)
        hkv, m = lean.cent.shape[:2]
        sub_q = self._split(q.float().view(hkv, -1, q.shape[-1]).sum(1, keepdim=True))  # [Hkv, 1, m, d_b]
        cos = torch.einsum("hgmd,hmcd->hgmc", F.normalize(sub_q, dim=-1), lean.cent)
        ids = torch.topk(cos, 1, dim=-1).indices  # [Hkv, 1, m, 1]
        wts = sub_q.norm(dim=-1)[..., None] if self.params.weighting == "qnorm" else torch.ones(ids.shape)
        if ROW_KEYS in t:
            rows, scale = lean.routed_rows(ids, t[ROW_KEYS])
        else:
            rows, scale = self._routed_rows(t, lean.hh, lean.mm, ids)
        scores = int_dot_scores(rows, wts.reshape(hkv, -1) * scale)  # [Hkv, N]
        new = state.extra.get("new_scores")  # [Hkv, m, C, T]: keys appended during decode
        if new is None and scores.shape[-1] == n:
            return scores[:, None]
        acc = torch.zeros(hkv, 1, n)
        acc[:, 0, :scores.shape[-1]] = scores
        if new is not None:  # every appended key is listed (floor -inf, offset 0): its score counts
            start = state.extra["new_start"]
            acc[..., start:start + new.shape[-1]] += (new[lean.hh, lean.mm, ids] * wts[..., None]).sum((2, 3))
        return acc

    def _routed_rows(self, t: Tables, hh: torch.Tensor, mm: torch.Tensor, ids: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The routed rows [Hkv, R, N] (R = G * m * tau, in ids' order) and, int8, their scales
        [Hkv, R]: read from the materialized rows, or computed for just these centroids from the
        subspace keys (restore on_demand), bitwise the same rows (csattention_rows)."""
        hkv = ids.shape[0]
        if ROW_KEYS in t:
            return routed_rows(t["centroids"][hh, mm, ids], t[ROW_KEYS], self.params.int8_tables)
        dense = t["dense_score"]  # [Hkv, m, C, N]
        # one index_select of the chosen rows + a batched matvec: 6x faster on CPU than
        # advanced indexing with broadcast index tensors followed by an einsum
        flat = ((hh * dense.shape[1] + mm) * dense.shape[2] + ids).flatten()
        rows = dense.reshape(-1, dense.shape[-1]).index_select(0, flat).view(hkv, -1, dense.shape[-1])
        scale = t["dense_scale"].reshape(-1)[flat].view(hkv, -1) if "dense_scale" in t else None
        return rows, scale

    def _score_offset(self, t: Tables, hh, mm, ids, floor: torch.Tensor) -> torch.Tensor:
        """What an unlisted key is taken to score, subtracted from listed scores:
        0 (paper), the list floor (an upper bound), or the mean score of unlisted keys."""
        how = self.params.scoring
        if how == "absolute":
            return torch.zeros_like(floor)
        if how == "relative":
            return floor
        return t["list_absent_mean"][hh, mm, ids].float()

    def _subspace_weights(self, sub_q: torch.Tensor, cent: torch.Tensor,
                          ids: torch.Tensor) -> torch.Tensor:
        """w_b [Hkv, G, m, tau]: unit; ||q_b||; or q_b . c (the query's projection on the
        centroid, which also discounts subspaces where routing matched poorly)."""
        p: CSAttentionParams = self.params
        if p.weighting == "unit":
            return torch.ones(ids.shape)
        if p.weighting == "qnorm":
            return sub_q.norm(dim=-1)[..., None].expand(ids.shape)
        hh = torch.arange(cent.shape[0])[:, None, None, None]
        mm = torch.arange(cent.shape[1])[None, None, :, None]
        return torch.einsum("hgmd,hgmtd->hgmt", sub_q, cent[hh, mm, ids]).clamp_min(0)

    def _add_streamed(self, state: LayerState, acc: torch.Tensor, ids: torch.Tensor,
                      wts: torch.Tensor, floor: torch.Tensor, offset: torch.Tensor) -> None:
        """Score keys appended during decode where they beat the chosen list's floor (the
        paper's try-insert condition)."""
        new = state.extra.get("new_scores")  # [Hkv, m, C, T]
        if new is None:
            return
        start = state.extra["new_start"]
        hh = torch.arange(ids.shape[0])[:, None, None, None]
        mm = torch.arange(ids.shape[2])[None, None, :, None]
        s = new[hh, mm, ids]  # [Hkv, G, m, tau, T]
        gain = torch.where(s > floor[..., None], s - offset[..., None], torch.zeros_like(s))
        acc[..., start:start + s.shape[-1]] += (gain * wts[..., None]).sum((2, 3))

    def _combine(self, est: torch.Tensor, head_dim: int) -> torch.Tensor:
        """Merge the group's per-head estimates [Hkv, G, n] into one ranking [Hkv, n]."""
        how = self.params.group_combine
        if how == "sum":
            return est.sum(1)
        if how == "max":
            return est.max(1).values
        return torch.softmax(est * head_dim ** -0.5, dim=-1).sum(1)

    def append(self, state: LayerState, k_new: torch.Tensor, start: int) -> None:
        cent = lean_state(state).cent
        s = torch.einsum("hmcd,hmtd->hmct", cent, self._split(k_new.float()).permute(0, 2, 1, 3))
        if "new_scores" not in state.extra:
            state.extra["new_scores"], state.extra["new_start"] = s, start
        else:
            state.extra["new_scores"] = torch.cat([state.extra["new_scores"], s], dim=-1)
