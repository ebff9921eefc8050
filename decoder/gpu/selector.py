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

from typing import TYPE_CHECKING

import torch

from ctxcache.decoder.gpu.tables import GpuDenseTables, GpuTables
from ctxcache.kernels.dense_dot8 import dense_dot8
from ctxcache.kernels.dense_select import dense_scores
from ctxcache.kernels.follow import promote_successors
from ctxcache.kernels.route import route
from ctxcache.kernels.scatter import scatter_lists
from ctxcache.kernels.stream import add_streamed
from ctxcache.kernels.sync import pdl_available
from ctxcache.kernels.topk import MAX_ROW, blocks16, radix_topk, workspace
from ctxcache.methods.csattention import CSAttentionParams
from ctxcache.methods.csattention_refs import subspace_permutation

if TYPE_CHECKING:
    from ctxcache.kernels.rerank import Reranker


def check_params(p: CSAttentionParams) -> None:
    if not p.gpu_selectable:
        raise ValueError(f"GPU selection supports backoff_cos=-1, group_combine='sum', weighting "
                         f"unit|qnorm and scoring absolute|relative|expected; got "
                         f"backoff_cos={p.backoff_cos}, group_combine={p.group_combine!r}, weighting={p.weighting!r}, "
                         f"scoring={p.scoring!r}")


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
