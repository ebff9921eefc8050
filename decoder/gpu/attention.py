"""Graph-capturable attention callables for the model: split-K dense and CSAttention sparse.

Both take the per-row lengths from the device (pos), never from the host, so a decode step
can be captured once and replayed. Multi-token steps (prompt prefill) attend densely through
the reference path and are not meant to be captured."""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

from ctxcache.decoder.gpu.selector import GpuSelector
from ctxcache.decoder.gpu.tables import GpuDenseTables, GpuTables, follow_state, reselect_state
from ctxcache.kernels.carried_attention import carried_attention
from ctxcache.kernels.carry import carry_candidates
from ctxcache.kernels.rerank import Reranker
from ctxcache.kernels.split_k_attention import choose_splits, partial_workspace, sparse_decode_attention
from ctxcache.methods import Budget
from ctxcache.methods.csattention import CSAttentionParams
from ctxcache.models.attention import dense_attention
from ctxcache.models.kv_cache import KVCache

# Sparse attention split-K shape: splits cover the SMs `waves` times with >= min_keys keys each;
# block_n keys per inner step (measured best on the H100 at 128K).
ATTN_CFG = {"waves": 2, "min_keys": 128, "block_n": 128, "num_warps": 4, "num_stages": None}
# the carried attention (every step at reselect > 1) pipelines two stages: H200, `bench shapes --kernels
# carried`, a lean step's layer at the decoder's splits: 32K x 8 34.2 -> 31.8 us, x 1 14.6 -> 13.7; the
# device step in one call (step_profile_h200) 7.79 / 7.51 ms vs 7.80 at x 8, 5.61 / 5.62 vs 5.67 at x 1
CARRIED_STAGES = 2


class GpuDenseAttention:
    """Split-K flash-decoding over all cached keys (the dense baseline that graphs can hold)."""

    def __init__(self, batch: int, n_kv: int, max_len: int) -> None:
        self.splits = choose_splits(batch * n_kv, max_len)
        self._n: torch.Tensor | None = None  # the step's lengths, from its first layer

    def __call__(self, layer: int, q: torch.Tensor, cache: KVCache, pos: torch.Tensor,
                 n: torch.Tensor | None = None) -> torch.Tensor:
        if q.shape[2] > 1:
            return dense_attention(layer, q, cache, pos)
        if n is None:  # once a step: two launches a layer were 2.4 us (H200, 32K x 1)
            if layer == 0 or self._n is None:
                self._n = (pos[:, 0] + 1).int()
            n = self._n
        out = sparse_decode_attention(q[:, :, 0], cache.k[layer], cache.v[layer], n, splits=self.splits)
        return out[:, :, None]


class StepLimits(NamedTuple):
    """A step's per-row bounds [B] int32 on the device: the region [lo, hi), K, the re-rank's
    candidates kc and follow's kf; what the selector takes ([lo, sel_hi), sel_kc: empty for rows
    carrying their last selection); reselect's carried rows and last K (None without it)."""
    lo: torch.Tensor
    hi: torch.Tensor
    k: torch.Tensor
    kc: torch.Tensor
    kf: torch.Tensor | None
    sel_hi: torch.Tensor
    sel_kc: torch.Tensor
    carried: torch.Tensor | None = None
    kp: torch.Tensor | None = None


class GpuSparseAttention:
    """CSAttention decode on the GPU: index the new key, select, attend (sinks + top-K + recent).

    tables[layer] hold all rows' tables of either layout (table_stacks.stack_tables); dense_layers
    attend densely."""

    def __init__(self, params: CSAttentionParams, tables: list[GpuTables | GpuDenseTables], budget: Budget, batch: int,
                 n_heads: int, n_kv: int, head_dim: int, max_len: int, dense_layers: tuple[int, ...] = (),
                 attn_cfg: dict | None = None, rerank_key16: bool | None = None) -> None:
        self.params, self.tables, self.budget, self.dense_layers = params, tables, budget, dense_layers
        device = tables[0].centroids.device
        self.k_max = budget.top_k(max_len)
        # with an exact re-rank the selector proposes ceil(rerank * K) candidates per row
        self.kc_max = params.candidates(self.k_max, max_len)
        # follow: the rows' previous best re-ranked keys live in their tables (follow_prev; a
        # runner allocates them with its slots, so every batch size's view shares them)
        self.follow = params.follows if self.kc_max > self.k_max else 0
        # reselect: steps between the estimate's re-rank the last selection (chosen_prev), the
        # successors of its best keys and the key new to the region (kernels/carry.py)
        self.reselect = params.reselects if self.follow else 1
        # and marks a position per row and KV head for the carry kernel's membership test (a
        # working buffer beside the selector's 16-bit keys, at half their bytes)
        self.marks = None
        if self.reselect > 1:
            self.kc_max = max(self.kc_max, self.k_max + self.follow + 1)
            self.marks = torch.zeros(batch, n_kv, max_len, dtype=torch.int8, device=device)
        self.selector = GpuSelector(params, batch, n_heads, n_kv, head_dim, max_len, self.kc_max, device)
        for t in tables if self.follow else ():
            if not isinstance(t, GpuDenseTables):
                raise ValueError(f"follow={self.follow} needs the dense table layout (list_fraction=1)")
            if t.follow_prev is None:  # tables stacked for this attention alone (benches, tests)
                t.follow_prev = follow_state(batch, n_kv, self.follow, device)
            if self.reselect > 1 and t.chosen_prev is None:
                t.chosen_prev, t.reselect_left = reselect_state(batch, n_kv, self.k_max, device)
        self.reranker = (Reranker(batch, n_kv, n_heads // n_kv, self.kc_max, self.k_max, device, key16=rerank_key16,
                                  follow=self.follow, pdl=self.selector.pdl)
                         if self.kc_max > self.k_max else None)
        if self.reranker is not None and all(isinstance(t, GpuDenseTables) for t in tables):
            self.selector.zero_with_route(self.reranker)  # its route zeroes the re-rank's workspace too
        cfg = {**ATTN_CFG, **(attn_cfg or {})}
        # a carried row attends all its candidates (kernels/carried_attention.py), up to kc_max
        listed = (self.kc_max if self.reselect > 1 else self.k_max) + budget.sinks + budget.recent
        self.splits = choose_splits(batch * n_kv, listed, min_keys=cfg["min_keys"], waves=cfg["waves"])
        self.block_n = cfg["block_n"]
        self.launch = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
        # the carried attention's partials: a lean step's re-rank reads their (max, sum) pairs
        self.ws = (partial_workspace(batch, n_heads, n_kv, self.splits, head_dim, device) if self.reselect > 1
                   else None)
        self.dense = GpuDenseAttention(batch, n_kv, max_len)
        # a lean layer's re-rank (score + Top-K) feeds only the next step's carry: it runs on a side
        # stream beside the layer's projections and MLP, and the next layer's carry waits for it (it
        # rewrites the candidates, the partials and the workspace the re-rank reads); the last sparse
        # layer ranks in line, so a step (and its graph) ends joined. H200, 32K x 8, lean step 7.00 ->
        # 6.20 ms at reselect 2, 6.59 -> 6.29 at 4 (step_profile_inline_h200 vs step_profile_h200)
        self.side = torch.cuda.Stream(device) if self.reselect > 1 and torch.device(device).type == "cuda" else None
        self._last_sparse = max((i for i in range(len(tables)) if i not in dense_layers), default=-1)
        self._forked = False
        self._every_row = torch.ones(batch, dtype=torch.int32, device=device)  # a lean step's carried rows
        self._step: tuple[torch.Tensor, ...] = ()

    def carried(self) -> list[torch.Tensor]:
        """What each step reads and rewrites for the next: follow's previous best keys per layer,
        reselect's last selection and countdown (graph.carried_state)."""
        return [x for t in self.tables if self.follow for x in (t.follow_prev, t.chosen_prev, t.reselect_left)
                if x is not None]

    def _limits(self, n: torch.Tensor, decode: bool = True, carry_all: bool = False) -> StepLimits:
        """Budget.region, Budget.top_k and the re-rank's candidate count on the device (same
        double-precision ceil as the host), once per step; with reselect, which rows carry their
        last selection (their countdown moves here, before any launch of the step reads it; a
        prompt's step attends densely and moves nothing, as the reference's search does not run).
        carry_all (CarriedStep): every row carries, whatever its countdown says."""
        lo, hi, k = self._region(n)
        kf = k.clamp(max=self.follow) if self.follow else None
        if self.reselect == 1 or not decode:
            kc = self._candidates(lo, hi, k)
            return StepLimits(lo, hi, k, kc, kf, hi, kc)
        left = next(t.reselect_left for i, t in enumerate(self.tables) if i not in self.dense_layers)
        carried = left > 0
        left.copy_(torch.where(carried, left - 1, self.reselect - 1))
        _, _, kp = self._region(n - 1)  # the last step's K: its selection's length
        kc_carried = torch.minimum(kp + self.follow + 1, hi - lo)
        if carry_all:  # the selector does not run: sel_hi and sel_kc are read by nothing
            return StepLimits(lo, hi, k, kc_carried, kf, lo, kc_carried, self._every_row, kp)
        kc = self._candidates(lo, hi, k)
        return StepLimits(lo, hi, k, torch.where(carried, kc_carried, kc), kf, torch.where(carried, lo, hi),
                          torch.where(carried, 0, kc), carried.int(), kp)

    def _candidates(self, lo: torch.Tensor, hi: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """CSAttentionParams.candidates on the device: what the selector proposes with the re-rank
        on (a lean step proposes nothing and skips these launches)."""
        return torch.minimum(hi - lo, torch.ceil(k.double() * self.params.rerank - 1e-9).long()).int()

    def _region(self, n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Budget.region and Budget.top_k of rows of n keys, int32 on the device."""
        b = self.budget
        lo = torch.clamp(n, max=b.sinks)
        hi = torch.maximum(lo, n - b.recent)
        k = torch.minimum(torch.ceil(n.double() * b.keep).clamp(min=1).long(), (hi - lo).long())
        return lo.int(), hi.int(), k.int()

    def __call__(self, layer: int, q: torch.Tensor, cache: KVCache, pos: torch.Tensor,
                 carry_all: bool = False) -> torch.Tensor:
        if layer == 0 or not self._step:  # every layer of a step shares the rows, positions and limits
            n = (pos[:, 0] + 1).int()
            self._step = (pos.int(), n, self._limits(n, decode=pos.shape[1] == 1, carry_all=carry_all))
            self._forked = False  # (a step that raised mid-way left no fork a new one may join)
        pos32, n, lim = self._step
        for t in range(pos.shape[1]):
            self.tables[layer].insert(cache.k[layer], pos32[:, t].contiguous(), self.selector.perm, self.selector.pdl)
        if q.shape[2] > 1:
            return self._prefill(layer, q, cache, pos)
        if layer in self.dense_layers:
            return self.dense(layer, q, cache, pos, n)
        if carry_all:
            return self._lean(layer, q[:, :, 0], cache, n, lim)[:, :, None]
        if self.reranker is not None:
            idx = self._rerank(layer, q[:, :, 0], cache, n, lim)
        else:
            idx = self.selector.select(q[:, :, 0], self.tables[layer], lim.lo, lim.hi, lim.k)
        if self.reselect > 1:  # a carried row attends its candidates (the selector's idx), not its selection
            return self._attend_carried(layer, q[:, :, 0], cache, n, idx, lim)[:, :, None]
        return self._attend(layer, q[:, :, 0], cache, n, idx, lim.k)[:, :, None]

    def _rerank(self, layer: int, q: torch.Tensor, cache: KVCache, n: torch.Tensor, lim: StepLimits) -> torch.Tensor:
        """The selector's candidates (follow: the successors promoted; reselect: rows carrying their
        last selection select nothing, and carry_candidates writes theirs), re-ranked exactly."""
        t = self.tables[layer]
        cand = self.selector.select(q, t, lim.lo, lim.sel_hi, lim.sel_kc)
        if self.reselect > 1:
            self._carry(t, lim, cand)
        return self.reranker(q, cache.k[layer], cand, lim.kc, lim.k, lim.lo, lim.hi, n, self.budget.sinks,
                             self.budget.recent, t.follow_prev if self.follow else None, lim.kf,
                             positions=t.chosen_prev if self.reselect > 1 else None)

    def _carry(self, t: GpuDenseTables, lim: StepLimits, cand: torch.Tensor, zero: torch.Tensor | None = None) -> None:
        carry_candidates(t.chosen_prev, t.follow_prev, lim.carried, lim.lo, lim.hi, lim.kp, lim.kc, cand,
                         self.marks, pdl=self.selector.pdl, zero=zero)

    def _lean(self, layer: int, q: torch.Tensor, cache: KVCache, n: torch.Tensor, lim: StepLimits) -> torch.Tensor:
        """A lean step's layer: no selector launch; every row attends all its candidates, and the
        re-rank ranks them from the attention's logits for the next step's carry (the carry launch
        zeroes the re-rank's workspace, the route launch's side job otherwise)."""
        t, cand = self.tables[layer], self.selector.idx
        if self._forked:  # the previous layer's re-rank, on the side stream, is done with the buffers
            torch.cuda.current_stream().wait_stream(self.side)
            self._forked = False
        self._carry(t, lim, cand, zero=self.reranker.ws_pair)
        out = self._attend_carried(layer, q, cache, n, cand, lim, self.reranker.logits)
        beside = self.side is not None and layer != self._last_sparse
        if beside:
            self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side) if beside else contextlib.nullcontext():
            self.reranker.rank(q.dtype, cand, lim.kc, lim.k, self.ws[1], self.splits, True, t.follow_prev, lim.kf,
                               positions=t.chosen_prev)
        self._forked = beside
        return out

    def _prefill(self, layer: int, q: torch.Tensor, cache: KVCache, pos: torch.Tensor) -> torch.Tensor:
        """A prompt's tokens attend densely (the keys are indexed already)."""
        out = dense_attention(layer, q, cache, pos)
        self._seed(layer, q, cache.k[layer], pos)
        return out

    def _seed(self, layer: int, q: torch.Tensor, keys: torch.Tensor, pos: torch.Tensor) -> None:
        """follow: each row's last prompt query seeds its follow state (GpuDenseTables.seed_follow;
        keys [B, Hkv, >= n, D] on the GPU). Not captured: a prompt's step reads its lengths."""
        if not self.follow or layer in self.dense_layers:
            return
        for b in range(q.shape[0]):
            self.tables[layer].seed_follow(b, q[b, :, -1], keys[b, :, :int(pos[b, -1]) + 1], self.budget)

    def _attend_carried(self, layer: int, q: torch.Tensor, cache: KVCache, n: torch.Tensor, idx: torch.Tensor,
                        lim: StepLimits, logits: torch.Tensor | None = None) -> torch.Tensor:
        """reselect: the rows not carried attend their selection idx, the carried ones all their
        candidates (the selector's idx); logits: as carried_attention's (a lean step)."""
        return carried_attention(q, cache.k[layer], cache.v[layer], n, idx, lim.k, self.selector.idx, lim.kc,
                                 lim.carried, self.budget.sinks, self.budget.recent, self.splits, self.ws,
                                 logits=logits, block_n=self.block_n, pdl=self.selector.pdl,
                                 num_warps=self.launch["num_warps"], num_stages=CARRIED_STAGES)

    def _attend(self, layer: int, q: torch.Tensor, cache: KVCache, n: torch.Tensor, idx: torch.Tensor,
                k: torch.Tensor) -> torch.Tensor:
        """Sinks + the selection idx (first k[b] per row) + the recent window: q [B, Hq, D] -> [B, Hq, D]."""
        return sparse_decode_attention(q, cache.k[layer], cache.v[layer], n, idx, k, self.budget.sinks,
                                       self.budget.recent, splits=self.splits, block_n=self.block_n,
                                       pdl=self.selector.pdl, **self.launch)


class CarriedStep:
    """A GpuSparseAttention's lean step (reselect > 1): every row carries its last selection, so
    no selector kernel launches (route, scores, promote, radix Top-K). The runner replays it only
    where every stepped row carries (reselect_phase.ReselectPhase); a row of the batch it does
    not step computes a throw-away token from what its state holds (stale or zero positions)."""

    def __init__(self, attn: GpuSparseAttention) -> None:
        if attn.reselect == 1:
            raise ValueError("a lean step needs reselect > 1 with follow and an exact re-rank")
        self.attn = attn

    def __call__(self, layer: int, q: torch.Tensor, cache: KVCache, pos: torch.Tensor) -> torch.Tensor:
        if q.shape[2] > 1:
            raise ValueError("a lean step decodes one token a row")
        return self.attn(layer, q, cache, pos, carry_all=True)

    def carried(self) -> list[torch.Tensor]:
        return self.attn.carried()
