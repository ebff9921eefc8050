"""A layer's CSAttention tables for a batch of rows on the GPU, for both layouts, with the
per-row state a decode step carries to the next (follow's previous best keys; reselect's previous
selection and its countdown). GpuSelector (selector.py) reads them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ctxcache.kernels.seed_probs import RADIX_BLOCK, seed_topk, workspace_columns
from ctxcache.kernels.stream import span_insert, stream_insert
from ctxcache.kernels.topk import blocks16, workspace
from ctxcache.methods.budget import Budget
from ctxcache.methods.int8_tables import quantize_rows

if TYPE_CHECKING:
    from ctxcache.decoder.gpu.slot_prefill import SeedPadding


@dataclass
class GpuTables:
    """One layer's tables for a batch, stacked on a leading row dim (stride 0 when shared):
    centroids [B, Hkv, m, C, d_b] fp16, list_idx/list_score [B, Hkv, m, C, L], list_floor
    [B, Hkv, m, C]; streamed overlay new_scores [B, Hkv, m, C, T] fp32 for keys at
    positions stream_start[b] + t, t < stream_count[b]."""

    centroids: torch.Tensor
    list_idx: torch.Tensor
    list_score: torch.Tensor
    list_floor: torch.Tensor
    new_scores: torch.Tensor
    stream_start: torch.Tensor
    stream_count: torch.Tensor
    list_absent_mean: torch.Tensor | None = None  # [B, Hkv, m, C], for scoring="expected"

    def offset(self, scoring: str) -> torch.Tensor:
        """What an unlisted key is taken to score (CSAttention._score_offset), [B, Hkv, m, C]."""
        if scoring == "relative":
            return self.list_floor
        if scoring == "expected":
            if self.list_absent_mean is None:
                raise ValueError("scoring='expected' needs the list_absent_mean table")
            return self.list_absent_mean
        if getattr(self, "_zeros", None) is None:
            self._zeros = torch.zeros_like(self.list_floor)
        return self._zeros

    @classmethod
    def stack(cls, per_row: list[dict[str, torch.Tensor]], n_ctx: list[int], max_new: int,
              device: torch.device | str) -> "GpuTables":
        """Stack rows' tables (different contexts), padding lists to the longest L with
        entries whose score equals the floor (they add exactly 0)."""
        if any("dense_score" in t for t in per_row):
            raise ValueError("dense full-list tables: use GpuDenseTables.stack (or table_stacks.stack_tables)")
        l_max = max(t["list_idx"].shape[-1] for t in per_row)
        idx, score = [], []
        for t in per_row:
            pad = l_max - t["list_idx"].shape[-1]
            idx.append(torch.nn.functional.pad(t["list_idx"], (0, pad)))
            floor = t["list_floor"][..., None].expand(*t["list_floor"].shape, pad)
            score.append(torch.cat([t["list_score"], floor], dim=-1))
        hkv, m, c = per_row[0]["list_floor"].shape
        dev = dict(device=device)
        absent = (torch.stack([t["list_absent_mean"] for t in per_row]).to(**dev).contiguous()
                  if all("list_absent_mean" in t for t in per_row) else None)
        return cls(torch.stack([t["centroids"] for t in per_row]).to(**dev),
                   torch.stack(idx).to(**dev).contiguous(), torch.stack(score).to(**dev).contiguous(),
                   torch.stack([t["list_floor"] for t in per_row]).to(**dev).contiguous(),
                   torch.zeros(len(per_row), hkv, m, c, max(max_new, 1), **dev),
                   torch.tensor(n_ctx, dtype=torch.int32, **dev),
                   torch.zeros(len(per_row), dtype=torch.int32, **dev), absent)

    def insert(self, k: torch.Tensor, pos: torch.Tensor, perm: torch.Tensor | None, pdl: bool = False) -> None:
        """Index the keys at positions pos [B] int32: k is the new keys [B, Hkv, D] or the
        layer's cache [B, Hkv, S, D] (graph-safe, one launch; pdl: a dependent launch)."""
        stream_insert(k, self.centroids, self.new_scores, pos, self.stream_start, self.stream_count, perm, pdl)


@dataclass
class GpuDenseTables:
    """One layer's dense full-list tables for a batch (leading row dim, stride 0 when shared):
    centroids [B, Hkv, m, C, d_b] fp16; dense_score [B, Hkv, m, C, N] fp16, or int8 with
    score_scale [B, Hkv, m, C] fp32; n_ctx [B] keys in the table per row; streamed overlay
    new_scores [B, Hkv, m, C, T] fp32 for keys at stream_start[b] + t (= n_ctx[b] + t);
    follow_prev [B, Hkv, F] int32 (CSAttention's follow = F > 0): the row's previous best
    re-ranked keys, -1 where none; with reselect > 1, chosen_prev [B, Hkv, K] int32: the row's
    last selection (its first k), and reselect_left [B] int32: steps until the estimate selects
    again (0: this step; a new stream starts at 0)."""

    centroids: torch.Tensor
    dense_score: torch.Tensor
    score_scale: torch.Tensor | None
    n_ctx: torch.Tensor
    new_scores: torch.Tensor
    stream_start: torch.Tensor
    stream_count: torch.Tensor
    follow_prev: torch.Tensor | None = None
    chosen_prev: torch.Tensor | None = None
    reselect_left: torch.Tensor | None = None

    @classmethod
    def stack(cls, per_row: list[dict[str, torch.Tensor]], n_ctx: list[int], max_new: int,
              device: torch.device | str, score_dtype: str = "float16") -> "GpuDenseTables":
        """Stack rows' dense tables (zero-padded to the longest N, rounded up to 16 keys so the
        score kernel can use vector loads; the kernel masks by n_ctx). score_dtype "int8"
        quantizes fp16 tables' (head, subspace, centroid) rows each with its own scale; tables
        built as int8 (with "dense_scale") are used as stored, whatever score_dtype says."""
        if score_dtype not in ("float16", "int8"):
            raise ValueError(f"score_dtype={score_dtype!r} must be float16 or int8")
        n_max = -(-max(t["dense_score"].shape[-1] for t in per_row) // 16) * 16
        stored8 = ["dense_scale" in t for t in per_row]
        if any(stored8) and not all(stored8):
            raise ValueError("rows mix int8 and fp16 dense tables")
        pad = [(0, n_max - t["dense_score"].shape[-1]) for t in per_row]
        if all(stored8):  # built as int8 (CSAttention table_dtype="int8"): used as stored
            dense = torch.stack([F.pad(t["dense_score"], p) for t, p in zip(per_row, pad)]).to(device)
            scale = torch.stack([t["dense_scale"].float() for t in per_row]).to(device)
        else:
            dense = torch.stack([F.pad(t["dense_score"].half(), p) for t, p in zip(per_row, pad)]).to(device)
            scale = None
            if score_dtype == "int8":
                dense, scale = quantize_rows(dense)
        hkv, m, c = dense.shape[1:4]
        dev = dict(device=device)
        n = torch.tensor(n_ctx, dtype=torch.int32, **dev)
        return cls(torch.stack([t["centroids"] for t in per_row]).to(**dev), dense.contiguous(), scale, n,
                   torch.zeros(len(per_row), hkv, m, c, max(max_new, 1), **dev), n.clone(),
                   torch.zeros(len(per_row), dtype=torch.int32, **dev))

    def insert(self, k: torch.Tensor, pos: torch.Tensor, perm: torch.Tensor | None, pdl: bool = False) -> None:
        """As GpuTables.insert."""
        stream_insert(k, self.centroids, self.new_scores, pos, self.stream_start, self.stream_count, perm, pdl)

    @classmethod
    def empty(cls, rows: int, like: dict[str, torch.Tensor], n_max: int, max_new: int,
              device: torch.device | str, follow: int = 0, chosen: int = 0) -> "GpuDenseTables":
        """Zeroed int8 tables for `rows` rows of up to n_max keys, shaped like one artifact
        layer's int8 tables `like` (centroids, dense_score, dense_scale); rows hold no keys.
        follow, chosen: the widths of follow_prev and chosen_prev (0: none)."""
        if "dense_scale" not in like:
            raise ValueError("GpuDenseTables.empty takes int8 dense tables (with dense_scale)")
        hkv, m, c = like["dense_score"].shape[:3]
        n_pad = -(-n_max // 16) * 16
        dev = dict(device=device)
        n = torch.zeros(rows, dtype=torch.int32, **dev)
        return cls(torch.zeros(rows, *like["centroids"].shape, dtype=like["centroids"].dtype, **dev),
                   torch.zeros(rows, hkv, m, c, n_pad, dtype=torch.int8, **dev),
                   torch.zeros(rows, hkv, m, c, **dev), n, torch.zeros(rows, hkv, m, c, max(max_new, 1), **dev),
                   n.clone(), n.clone(), follow_state(rows, hkv, follow, device) if follow else None,
                   *(reselect_state(rows, hkv, chosen, device) if chosen else (None, None)))

    def rows(self, start: int, end: int) -> "GpuDenseTables":
        """A view of rows [start, end) sharing storage with these tables."""
        return GpuDenseTables(*(None if t is None else t[start:end] for t in (
            self.centroids, self.dense_score, self.score_scale, self.n_ctx, self.new_scores,
            self.stream_start, self.stream_count, self.follow_prev, self.chosen_prev, self.reselect_left)))

    def load_row(self, row: int, tables: dict[str, torch.Tensor], n: int) -> None:
        """Copy one artifact layer's int8 tables (n keys) into row `row`; no streamed keys yet."""
        self.centroids[row].copy_(tables["centroids"], non_blocking=True)
        self.dense_score[row, ..., :n].copy_(tables["dense_score"], non_blocking=True)
        self.score_scale[row].copy_(tables["dense_scale"], non_blocking=True)
        self.n_ctx[row:row + 1].fill_(n)  # no host-scalar copy (a stream sync)
        self.reset_stream(row)

    def insert_span(self, row: int, keys: torch.Tensor, col: int, perm: torch.Tensor | None,
                    real: torch.Tensor) -> None:
        """Index keys [Hkv, T, D] streamed into row `row` as its columns col..col+T-1 (positions
        n_ctx + col ...; a prompt's prefill: one launch a layer, where a torch product with its fp32
        copies and write-back took seven, ~0.4 ms of a 32K hot admission on the H200); the same fp32
        centroid . key-subspace scores stream_insert writes. The column comes from the host, and the
        count is raised on the device: no host sync per layer. Only the first `real` (int32 [1],
        device) keys count: a prompt is padded to its graph's length, and the padding's columns
        are overwritten by the stream's own keys."""
        span_insert(keys, self.centroids[row], self.new_scores[row], col, self.stream_count[row:row + 1], real, perm)

    def reset_stream(self, row: int | slice) -> None:
        """Forget the keys streamed into row `row` (or rows: layer_tables' rows of every layer)
        after its context (a new stream starts)."""
        self.stream_start[row] = self.n_ctx[row]
        self.stream_count[row].fill_(0)  # no host-scalar copy (a stream sync)
        if self.follow_prev is not None:
            self.follow_prev[row].fill_(-1)  # a new stream follows nothing until its prefill seeds it
        if self.reselect_left is not None:
            self.reselect_left[row].fill_(0)  # its first step selects (it has no last selection)

    def seed_follow(self, row: int, q: torch.Tensor, keys: torch.Tensor, budget: Budget,
                    padded: SeedPadding | None = None) -> None:
        """The prompt's last query q [Hq, D] over the row's keys [Hkv, n, D]: its `follow` best
        keys in the budget's region by exact attention stand in for a previous step's re-rank
        (CSAttention.observe_dense). `padded`: the region's bounds come from the device, made
        once per prompt (SeedPadding): where the last keys pad a prompt to its graph's length, a
        prefill graph replays for any prompt length it was padded to."""
        if self.follow_prev is None:
            return
        prev = self.follow_prev[row]
        if padded is None or not padded.complete:  # (complete: the Top-K overwrites all of it)
            prev.fill_(-1)
        hkv, n, d = keys.shape
        lo, hi = budget.region(n)
        if min(prev.shape[-1], hi - lo) <= 0:  # (the real keys' region is no larger)
            return
        bounds, ws = self.seed_buffers(n)
        if padded is None:
            for i, v in enumerate((lo, hi, min(prev.shape[-1], hi - lo))):
                bounds[i:i + 1].fill_(v)  # no host-scalar copy (a stream sync)
        else:  # the padding's keys weigh nothing (they sit after the real ones, past the region)
            bounds = padded.bounds
        # one compiled shape of the radix kernels whatever the length (rows padded to 16 keys);
        # torch.topk of 128 over 8 rows of 32K took ~0.7 ms a layer on the H100 (one block a row)
        seed_topk(q, keys, bounds, ws, prev[None], *((None, None) if padded is None else (padded.keys, padded.mask)))

    def seed_buffers(self, n: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """seed_follow's region bounds and radix workspace for n keys: made on first use for as many
        keys as a row holds (its context and streamed keys), before any prefill graph captures a
        seed (a prompt's prefill runs eagerly before its graph is captured). A longer prompt's
        padding gets a larger workspace; the old one stays alive for the graphs that captured it."""
        seed = getattr(self, "_seed", None)
        if seed is None or seed[1].shape[1] < workspace_columns(n):
            dev = self.follow_prev.device
            keys = max(n, self.dense_score.shape[-1] + self.new_scores.shape[-1])
            self._seed_kept = [] if seed is None else [*self._seed_kept, seed]
            self._seed = (torch.zeros(3, dtype=torch.int32, device=dev),
                          workspace(self.follow_prev.shape[1], dev, blocks16(keys + 16, RADIX_BLOCK)))
        return self._seed


def follow_state(rows: int, n_kv: int, follow: int, device: torch.device | str) -> torch.Tensor:
    """GpuDenseTables.follow_prev for rows that follow nothing yet."""
    return torch.full((rows, n_kv, follow), -1, dtype=torch.int32, device=device)


def reselect_state(rows: int, n_kv: int, k_max: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """GpuDenseTables.chosen_prev and reselect_left for rows whose next step selects. The
    selection starts as key 0, never -1: a lean step (attention.CarriedStep) carries every row of
    its batch, a never-stepped one too, and its throw-away token must read keys inside the row."""
    return (torch.zeros((rows, n_kv, k_max), dtype=torch.int32, device=device),
            torch.zeros(rows, dtype=torch.int32, device=device))
