"""CSAttention selection on the GPU: route -> scatter lists -> add streamed keys -> radix Top-K.

Static buffers sized once (rows, heads, max context, max K), so a step is a fixed sequence of
launches that a CUDA graph can capture. Matches CSAttention.search with tau = 1 (no backoff)
and group_combine = "sum"; other settings are refused rather than silently changed."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ctxcache.kernels.route import route
from ctxcache.kernels.scatter import scatter_lists
from ctxcache.kernels.stream import add_streamed, stream_insert
from ctxcache.kernels.topk import radix_topk, workspace
from ctxcache.methods.csattention import CSAttentionParams, subspace_permutation


def check_params(p: CSAttentionParams) -> None:
    if (p.backoff_cos > -1.0 or p.group_combine != "sum" or p.weighting not in ("unit", "qnorm")
            or p.scoring not in ("absolute", "relative", "expected")):
        raise ValueError(f"GPU selection supports backoff_cos=-1, group_combine='sum', weighting "
                         f"unit|qnorm and scoring absolute|relative|expected; got backoff_cos={p.backoff_cos}, "
                         f"group_combine={p.group_combine!r}, weighting={p.weighting!r}, scoring={p.scoring!r}")


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
            raise ValueError("the GPU selector supports list tables (list_fraction < 1); the dense "
                             "full-list layout runs on the torch reference path only")
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

    def insert(self, k_new: torch.Tensor, pos: torch.Tensor, perm: torch.Tensor | None) -> None:
        """Index keys k_new [B, Hkv, D] written at positions pos [B] int32 (graph-safe)."""
        k = k_new[..., perm] if perm is not None else k_new
        col = (pos - self.stream_start).int()
        stream_insert(k.contiguous(), self.centroids, self.new_scores, col)
        torch.maximum(self.stream_count, col + 1, out=self.stream_count)


class GpuSelector:
    """Reusable buffers for selecting up to k_max keys per (row, KV head) among n_max."""

    def __init__(self, params: CSAttentionParams, batch: int, n_heads: int, n_kv: int, head_dim: int,
                 n_max: int, k_max: int, device: torch.device | str) -> None:
        check_params(params)
        m = params.subspaces
        perm = subspace_permutation(head_dim, m, params.layout)
        self.perm = None if params.layout == "contiguous" else perm.to(device)
        self.params = params
        self.ids = torch.zeros(batch, n_heads, m, dtype=torch.int32, device=device)
        self.w = torch.zeros(batch, n_heads, m, device=device)
        self.acc = torch.zeros(batch, n_kv, n_max, device=device)
        self.ws = workspace(batch * n_kv, device)
        self.idx = torch.zeros(batch, n_kv, k_max, dtype=torch.int32, device=device)

    def route_scatter(self, q: torch.Tensor, t: GpuTables) -> torch.Tensor:
        """Estimated scores acc [B, Hkv, n_max] of q [B, Hq, D]."""
        qs = q[..., self.perm] if self.perm is not None else q
        route(qs.contiguous(), t.centroids, out=(self.ids, self.w))
        if self.params.weighting == "unit":
            self.w.fill_(1.0)
        offset = t.offset(self.params.scoring)
        self.acc.zero_()
        scatter_lists(self.ids, self.w, t.list_idx, t.list_score, offset, self.acc, relative=True)
        add_streamed(self.ids, self.w, t.new_scores, t.list_floor, t.stream_count, t.stream_start,
                     self.acc, offset)
        return self.acc

    def select(self, q: torch.Tensor, t: GpuTables, lo: torch.Tensor, hi: torch.Tensor,
               k: torch.Tensor) -> torch.Tensor:
        """-> idx [B, Hkv, k_max] int32; row b's first k[b] entries are its selection."""
        self.route_scatter(q, t)
        return radix_topk(self.acc, lo, hi, k, self.idx, self.ws)
