"""CSAttention selection on the GPU, for both table layouts.

List layout (list_fraction < 1): route -> scatter lists -> add streamed keys -> radix Top-K.
Dense layout (list_fraction = 1, the measured default): route -> weighted sum of the G * m
routed rows of dense_score (m rows with routing="group") with streamed keys and radix pass 0
fused (dense_select), written as 16-bit keys of the fp16-rounded scores -> radix pass 1 +
collect (ties to the lowest index, as CSAttention.search ranks); score_keys="fp32": fp32
scores and passes 1-3 + collect (ties in atomic order). int8 tables (CSAttention's default
table_dtype, or fp16 tables stacked with score_dtype="int8"; half the bytes) with 16-bit keys
are scored by integer dot products against int8-quantized routed weights (dense_dot8), the
reference's arithmetic, instead of dense_select's fp32 arithmetic.

Static buffers sized once (rows, heads, max context, max K), so a step is a fixed sequence of
launches that a CUDA graph can capture. Matches CSAttention.search with tau = 1 (no backoff)
and group_combine = "sum"; other settings are refused rather than silently changed.

follow (dense layout, 16-bit keys): each row keeps its previous step's `follow` best re-ranked
keys per KV head in its tables (GpuDenseTables.follow_prev, written by the re-rank, seeded by
the prompt's prefill: seed_follow); the selector raises their successors above every estimate
(kernels/follow.py) before the radix passes, as CSAttention.search promotes them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ctxcache.kernels.dense_dot8 import dense_dot8
from ctxcache.kernels.dense_select import dense_scores
from ctxcache.kernels.follow import promote_successors
from ctxcache.kernels.route import route
from ctxcache.kernels.scatter import scatter_lists
from ctxcache.kernels.seed_probs import seed_scores
from ctxcache.kernels.stream import add_streamed, stream_insert
from ctxcache.kernels.sync import pdl_available
from ctxcache.kernels.topk import MAX_ROW, blocks16, radix_topk, workspace
from ctxcache.methods.budget import Budget
from ctxcache.methods.csattention import CSAttentionParams
from ctxcache.methods.csattention_refs import subspace_permutation
from ctxcache.methods.int8_tables import quantize_rows

if TYPE_CHECKING:
    from ctxcache.decoder.gpu.slot_prefill import SeedPadding
    from ctxcache.kernels.rerank import Reranker


def check_params(p: CSAttentionParams) -> None:
    if not p.gpu_selectable:
        raise ValueError(f"GPU selection supports backoff_cos=-1, group_combine='sum', weighting "
                         f"unit|qnorm and scoring absolute|relative|expected; got "
                         f"backoff_cos={p.backoff_cos}, group_combine={p.group_combine!r}, weighting={p.weighting!r}, "
                         f"scoring={p.scoring!r}")


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
    re-ranked keys, -1 where none."""

    centroids: torch.Tensor
    dense_score: torch.Tensor
    score_scale: torch.Tensor | None
    n_ctx: torch.Tensor
    new_scores: torch.Tensor
    stream_start: torch.Tensor
    stream_count: torch.Tensor
    follow_prev: torch.Tensor | None = None

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
              device: torch.device | str, follow: int = 0) -> "GpuDenseTables":
        """Zeroed int8 tables for `rows` rows of up to n_max keys, shaped like one artifact
        layer's int8 tables `like` (centroids, dense_score, dense_scale); rows hold no keys."""
        if "dense_scale" not in like:
            raise ValueError("GpuDenseTables.empty takes int8 dense tables (with dense_scale)")
        hkv, m, c = like["dense_score"].shape[:3]
        n_pad = -(-n_max // 16) * 16
        dev = dict(device=device)
        n = torch.zeros(rows, dtype=torch.int32, **dev)
        return cls(torch.zeros(rows, *like["centroids"].shape, dtype=like["centroids"].dtype, **dev),
                   torch.zeros(rows, hkv, m, c, n_pad, dtype=torch.int8, **dev),
                   torch.zeros(rows, hkv, m, c, **dev), n, torch.zeros(rows, hkv, m, c, max(max_new, 1), **dev),
                   n.clone(), n.clone(), follow_state(rows, hkv, follow, device) if follow else None)

    def rows(self, start: int, end: int) -> "GpuDenseTables":
        """A view of rows [start, end) sharing storage with these tables."""
        return GpuDenseTables(*(None if t is None else t[start:end] for t in (
            self.centroids, self.dense_score, self.score_scale, self.n_ctx, self.new_scores,
            self.stream_start, self.stream_count, self.follow_prev)))

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
        n_ctx + col ...; a prompt's prefill: one product per layer instead of T stream_insert
        launches); the same fp32 centroid . key-subspace scores stream_insert writes. The column
        comes from the host, and the count is raised on the device: no host sync per layer.
        Only the first `real` (int32 [1], device) keys count: a prompt is padded to its graph's
        length, and the padding's columns are overwritten by the stream's own keys."""
        hkv, t, d = keys.shape
        cent = self.centroids[row].float()  # [Hkv, m, C, d_b]
        m, db = cent.shape[1], cent.shape[3]
        k = (keys[..., perm] if perm is not None else keys).float().view(hkv, t, m, db)
        self.new_scores[row, ..., col:col + t] = torch.einsum("hmcd,htmd->hmct", cent, k)
        self.stream_count[row:row + 1].clamp_(min=real + col if col else real)  # (col 0: no add to launch)

    def reset_stream(self, row: int | slice) -> None:
        """Forget the keys streamed into row `row` (or rows: layer_tables' rows of every layer)
        after its context (a new stream starts)."""
        self.stream_start[row] = self.n_ctx[row]
        self.stream_count[row].fill_(0)  # no host-scalar copy (a stream sync)
        if self.follow_prev is not None:
            self.follow_prev[row].fill_(-1)  # a new stream follows nothing until its prefill seeds it

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
        bounds, ws = self._seed_buffers()
        if padded is None:
            for i, v in enumerate((lo, hi, min(prev.shape[-1], hi - lo))):
                bounds[i:i + 1].fill_(v)  # no host-scalar copy (a stream sync)
        else:  # the padding's keys weigh nothing (they sit after the real ones, past the region)
            bounds = padded.bounds
        # [Hkv, n] as group_probabilities(q, keys).sum(1), in rows padded to 16 keys (one
        # compiled shape of the radix kernels whatever the length)
        probs = seed_scores(q, keys, *((None, None) if padded is None else (padded.keys, padded.mask)))
        # the radix Top-K: torch.topk of 128 over 8 rows of 32K took ~0.7 ms a layer on the
        # H100 (one block a row), 22 ms of a hot TTFT at 32K over 32 layers
        radix_topk(probs[None], bounds[0:1], bounds[1:2], bounds[2:3], prev[None], ws)

    def _seed_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """seed_follow's region bounds and radix workspace (made on first use, before any prefill
        graph captures a seed: a prompt's prefill runs eagerly before its graph is captured)."""
        if getattr(self, "_seed", None) is None:
            dev = self.follow_prev.device
            self._seed = (torch.zeros(3, dtype=torch.int32, device=dev), workspace(self.follow_prev.shape[1], dev))
        return self._seed


def follow_state(rows: int, n_kv: int, follow: int, device: torch.device | str) -> torch.Tensor:
    """GpuDenseTables.follow_prev for rows that follow nothing yet."""
    return torch.full((rows, n_kv, follow), -1, dtype=torch.int32, device=device)


PAD = 8192  # score rows are padded to a multiple of this (any power-of-two block up to it tiles them)


def radix_shape(rows: int, n_max: int, keys16: bool = True) -> tuple[int, int]:
    """(keys, warps) per radix program. The smallest block (>= 1024 keys, 4 warps) that keeps the
    grid within ~2048 programs, measured on the H100 for 16-bit keys at 8K-128K, batch 1 and 8
    (bench/step_probe.py at d74d176; fp32 passes are latency-bound: more, smaller programs help them the same
    way). Few rows (<= 8, batch 1) over long contexts (>= 64 programs of 4096 keys) take 4096 keys
    and 8 warps (16-bit keys): the 128K step 0.7-1.4 us faster in six comparisons over five
    calls, 32K 1.0-1.3 us (three), 64K 0.9 us (one); 8K slower."""
    if keys16 and rows <= 8 and rows * -(-n_max // 4096) >= 64:
        return 4096, 8
    return next((b for b in (1024, 2048) if rows * -(-n_max // b) <= 2048), 4096), 4


class GpuSelector:
    """Reusable buffers for selecting up to k_max keys per (row, KV head) among n_max.

    score_keys (dense layout): "fp16" ranks 16-bit keys of the fp16-rounded scores (two radix
    launches after the score kernel; ties are scores equal in fp16), "fp32" the fp32 scores
    (four launches)."""

    def __init__(self, params: CSAttentionParams, batch: int, n_heads: int, n_kv: int, head_dim: int,
                 n_max: int, k_max: int, device: torch.device | str, score_keys: str = "fp16",
                 pdl: bool | None = None) -> None:
        check_params(params)
        if score_keys not in ("fp16", "fp32"):
            raise ValueError(f"score_keys={score_keys!r} must be 'fp16' or 'fp32'")
        if params.follows and score_keys != "fp16":
            raise ValueError(f"follow={params.follow} promotes 16-bit keys: it needs score_keys='fp16'")
        m = params.subspaces
        perm = subspace_permutation(head_dim, m, params.layout)
        self.perm = None if params.layout == "contiguous" else perm.to(device)
        self.params = params
        self.group = params.routing == "group"
        routed = n_kv if self.group else n_heads
        self.ids = torch.zeros(batch, routed, m, dtype=torch.int32, device=device)
        self.w = torch.zeros(batch, routed, m, device=device)
        n_pad = -(-n_max // PAD) * PAD
        if n_pad >= MAX_ROW:
            raise ValueError(f"n_max={n_max}: the radix Top-K takes rows of fewer than {MAX_ROW} keys")
        self.rows, self.n_kv, self.device = batch * n_kv, n_kv, device
        # fp32 scores (list layout, or score_keys="fp32") only where used: 32 MB at batch 8 x 128K
        self.acc: torch.Tensor | None = None
        self.keys = torch.empty(batch, n_kv, n_pad, dtype=torch.uint16, device=device) if score_keys == "fp16" else None
        # tuned on the H100 at 128K, batch 1 and 8 (bench attention; the register cap lifts occupancy);
        # 4 warps: 4-6 us faster than 8 at batch 8, and with the row-aligned radix blocks 0.3-1.7 us
        # faster at batch 1 too (eight bench/step_probe.py calls, at d74d176)
        self.dense_cfg = {"block": 1024, "r_chunk": 8, "num_warps": 4, "maxnreg": 80}
        # int8 tables with 16-bit keys: integer dot products (kernels/dense_dot8), 16 keys per thread;
        # 2 warps, no register cap: route + scores + pass 0 23.3 / 10.9 / 33.9 us a layer at 32K x 8,
        # 32K x 1, 124K x 4 against 31.7 / 12.3 / 50.2 for 4 warps capped at 96 (H200, a sweep of
        # 512-4096 keys, 2-8 warps, caps 96 / 128 / none; the same keys in every config)
        self.dot8_cfg = {"block": 1024, "num_warps": 2, "maxnreg": None}
        self.n_pad = n_pad
        self.reranker: Reranker | None = None  # zero_with_route
        self.set_topk_block(*radix_shape(batch * n_kv, n_max, keys16=score_keys == "fp16"))
        self.idx = torch.zeros(batch, n_kv, k_max, dtype=torch.int32, device=device)
        # programmatic dependent launch between the step's kernels (None: where the GPU has it)
        self.pdl = pdl_available(device) if pdl is None else pdl
        # with PDL, each launch reads what the step did not write (centroids, row lengths)
        # before waiting for its predecessor (kernels/sync.py)
        self.pre_wait = True

    def set_topk_block(self, block: int, num_warps: int = 4) -> None:
        """Keys (and warps) per radix program; the workspace holds one histogram per block
        (16-bit keys)."""
        self.topk_block, self.topk_warps = block, num_warps
        self.ws = workspace(self.rows, self.device, blocks16(self.n_pad, block))
        self.zero = self.ws  # what the dense layout's route launch zeroes
        if self.reranker is not None:
            self.zero_with_route(self.reranker)

    def zero_with_route(self, reranker: Reranker) -> None:
        """The re-rank's workspace and this one in one buffer, zeroed by the route launch of
        route_dense (dense table layout only): one launch less a layer (a memset, 1.3 us on the
        H200 at 32K x 8) than the re-rank zeroing its own."""
        self.reranker = reranker
        buf = torch.zeros(self.ws.numel() + reranker.ws_pair.numel(), dtype=torch.int32, device=self.device)
        self.ws = buf[:self.ws.numel()].view(self.ws.shape)
        reranker.adopt_workspace(buf[self.ws.numel():].view(reranker.ws_pair.shape))
        self.zero = buf

    def _fp32_scores(self) -> torch.Tensor:
        """The fp32 score buffer, allocated on first use (before any graph capture: the
        capture helpers run the step first)."""
        if self.acc is None:
            self.acc = torch.zeros(self.rows // self.n_kv, self.n_kv, self.n_pad, device=self.device)
        return self.acc

    def route_scatter(self, q: torch.Tensor, t: GpuTables) -> torch.Tensor:
        """Estimated scores acc [B, Hkv, n_max] of q [B, Hq, D]."""
        self._route(q, t)
        offset = t.offset(self.params.scoring)
        acc = self._fp32_scores()
        acc.zero_()
        scatter_lists(self.ids, self.w, t.list_idx, t.list_score, offset, acc, relative=True)
        add_streamed(self.ids, self.w, t.new_scores, t.list_floor, t.stream_count, t.stream_start, acc, offset)
        return acc

    def route_dense(self, q: torch.Tensor, t: GpuDenseTables, lo: torch.Tensor, hi: torch.Tensor,
                    k: torch.Tensor, hist0: bool = True) -> torch.Tensor:
        """Dense layout: scores [B, Hkv, n_max] of q [B, Hq, D] (self.keys: uint16 keys, or
        self.acc: fp32), radix pass 0 into ws."""
        self._route(q, t, zero=self.zero)
        if self.keys is not None and t.score_scale is not None:
            return dense_dot8(self.ids, self.w, t.dense_score, t.score_scale, t.new_scores, t.n_ctx, t.stream_start,
                              t.stream_count, lo, hi, k, self.keys, self.ws, **self.dot8_cfg, hist0=hist0, pdl=self.pdl,
                              pre_wait=self.pre_wait)
        out = self.keys if self.keys is not None else self._fp32_scores()
        return dense_scores(self.ids, self.w, t.dense_score, t.score_scale, t.new_scores, t.n_ctx,
                            t.stream_start, t.stream_count, lo, hi, k, out, self.ws, **self.dense_cfg, hist0=hist0,
                            pdl=self.pdl)

    def _route(self, q: torch.Tensor, t: GpuTables | GpuDenseTables, zero: torch.Tensor | None = None) -> None:
        qs = q[..., self.perm] if self.perm is not None else q
        route(qs.contiguous(), t.centroids, out=(self.ids, self.w), group=self.group, zero=zero, pdl=self.pdl,
              pre_wait=self.pre_wait)
        if self.params.weighting == "unit":
            self.w.fill_(1.0)

    def select(self, q: torch.Tensor, t: GpuTables | GpuDenseTables, lo: torch.Tensor, hi: torch.Tensor,
               k: torch.Tensor) -> torch.Tensor:
        """-> idx [B, Hkv, k_max] int32; row b's first k[b] entries are its selection."""
        if isinstance(t, GpuDenseTables):
            scores = self.route_dense(q, t, lo, hi, k)
            if t.follow_prev is not None:  # its own launch: folded into the score kernel it was slower (DESIGN.md)
                promote_successors(scores, self.ws, t.follow_prev, lo, hi, k, pdl=self.pdl)
            return self.finish(scores, lo, hi, k)
        return radix_topk(self.route_scatter(q, t), lo, hi, k, self.idx, self.ws)

    def finish(self, scores: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """The Top-K after route_dense (which added pass 0 to the workspace)."""
        return radix_topk(scores, lo, hi, k, self.idx, self.ws, block=self.topk_block, hist0_done=True,
                          num_warps=self.topk_warps, pdl=self.pdl, pre_wait=self.pre_wait)
