"""CSAttention's exact re-rank on the GPU: of the candidates the tables propose, keep the K keys
with the largest attention probability summed over the GQA group.

The softmax of each query head is normalized over the candidates plus the keys a step reads
anyway (sinks and recent window), so the ranking is the oracle's over the keys read
(methods.csattention_refs.exact_rerank is the per-row reference, `rerank_ref` the batched torch one).

Four launches with 16-bit keys, all graph-capturable (lengths come from the device):
1. `_logits_kernel`: per (row, split) program, gathered candidate keys in blocks, one bf16 MMA per
   block for the group's query heads; writes the logits and the split's online-softmax (max,
   sum) per head. Split 0 also folds in the sinks and recent window.
2. `_score_kernel`: merges the splits' (max, sum) into each head's normalizer and writes the
   group-summed probability per candidate slot: for bf16 / fp16 models as the 16-bit radix key
   of its log2 (fp16: ~0.3% relative precision, so near-ties may swap), adding radix pass 0;
   for fp32 models as fp32 (the reference's exact order, four radix passes).
3. `topk_pair.radix_topk_pair` (16-bit keys): pass 1 and the collect over the slots [0, kc), the
   chosen slots written as key positions; with `follow` (CSAttention's follow > 0) the same two
   launches also take the best min(follow, k) candidates into follow_out (then -1). Four
   launches where two radix chains, a workspace copy, a gather and write_follow took nine:
   H200, 32K, a layer's select + re-rank + attention 156.6 -> 139.5 us at batch 8, 73.2 ->
   59.6 us at batch 1. fp32 models: four fp32 radix passes each, then the mapping launches.
Measured on the H100 at 32K batch 1 (time_us per piece): logits 17.7 us, fp32 scores + the
four-pass fp32 radix Top-K 10.4 + 50.8 us, 16-bit keys' Top-K 28.7 us.
Reading the candidates' keys (rerank x K keys, K only) is the cost: a third of the K/V bytes a
dense step reads at rerank 4 and keep 5% would be 20% of K."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ctxcache.kernels.sync import INTERPRET, launch_opts, pdl_enter
from ctxcache.kernels.follow import write_follow
from ctxcache.kernels.topk import _keys16, blocks16, radix_topk, workspace
from ctxcache.kernels.topk_pair import radix_topk_pair

BLOCK = 128  # candidate slots per inner step of the logits (H100 re-rank at 32K x 8: 101 us vs 112 at 64, 128K x 4: 156 vs 178; num_stages and 8 warps no better)
MIN_SPLITS = 16  # programs per row of the logits and the scores at least (Reranker)
SCORE_BLOCK = 256  # and of the scores (the key rows are padded to a multiple of it)
NEG: tl.constexpr = tl.constexpr(-1.0e30)  # finite "minus infinity" for running maxima (exp(NEG - NEG) is 1, not NaN)


def rerank_ref(q: torch.Tensor, keys: torch.Tensor, cand: torch.Tensor, kc: torch.Tensor, lo: torch.Tensor,
               hi: torch.Tensor, n: torch.Tensor, k_max: int, sinks: int, recent: int) -> torch.Tensor:
    """Batched torch reference: of row b's first kc[b] candidates cand [B, Hkv, KC], the keys
    with the largest group-summed attention probability, softmax over the candidates plus the
    keys outside [lo, hi) (sinks and recent window). q [B, Hq, D], keys [B, Hkv, L, D] ->
    [B, Hkv, k_max] int32, best first (row b reads its first k[b])."""
    b, hkv, n_cand = cand.shape
    d = keys.shape[-1]
    slot = torch.arange(n_cand, device=cand.device)
    cand_ok = (slot[None] < kc[:, None])[:, None] & (cand >= 0)  # [B, Hkv, KC] (-1: padding)
    cand_pos = torch.where(cand_ok, cand.long(), 0)
    others, others_ok = _others(lo, hi, n, sinks, recent)
    pos = torch.cat([cand_pos, torch.where(others_ok, others, 0)[:, None].expand(-1, hkv, -1)], dim=2)
    read = torch.gather(keys, 2, pos[..., None].expand(-1, -1, -1, d)).float()  # [B, Hkv, KC+S+R, D]
    logits = torch.einsum("bhgd,bhcd->bhgc", q.float().view(b, hkv, -1, d), read) * d ** -0.5
    valid = torch.cat([cand_ok, others_ok[:, None].expand(-1, hkv, -1)], dim=2)[:, :, None]  # [B, Hkv, 1, KC+S+R]
    prob = logits.masked_fill(~valid, float("-inf")).softmax(-1)
    score = prob[..., :n_cand].sum(2).masked_fill(~cand_ok, -1.0)  # [B, Hkv, KC]
    best = torch.topk(score, min(k_max, n_cand), dim=-1).indices
    return torch.gather(cand, 2, best).int()


def _others(lo: torch.Tensor, hi: torch.Tensor, n: torch.Tensor, sinks: int,
            recent: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions [B, S+R] of the sinks and the recent window, and which of them exist."""
    dev = lo.device
    pos = torch.cat([torch.arange(sinks, device=dev).expand(lo.shape[0], -1),
                     hi[:, None].long() + torch.arange(recent, device=dev)], dim=1)
    ok = torch.cat([pos[:, :sinks] < lo[:, None], pos[:, sinks:] < n[:, None]], dim=1)
    return pos, ok


@triton.jit
def _logits_kernel(q_ptr, k_ptr, cand_ptr, kc_ptr, lo_ptr, hi_ptr, n_ptr, logit_ptr, part_ptr,
                   HKV, KC, NSPLIT, sq_b, sq_h, sk_b, sk_h, sk_n, sc_b, sc_h, scale,
                   G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                   SINKS: tl.constexpr, RECENT: tl.constexpr, OB: tl.constexpr, IEEE: tl.constexpr,
                   USE_PDL: tl.constexpr):
    r = tl.program_id(0)
    split = tl.program_id(1)
    b = r // HKV
    h = r % HKV
    kc = tl.load(kc_ptr + b)
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, D)
    gmask = offs_g < G
    q = tl.load(q_ptr + b * sq_b + (h * G + offs_g)[:, None] * sq_h + offs_d[None, :], mask=gmask[:, None], other=0.0)
    pdl_enter(USE_PDL)  # kc and q come from before the selection (sync.py); the candidates need the wait
    kbase = k_ptr + b.to(tl.int64) * sk_b + h * sk_h
    m_i = tl.full([GP], NEG, tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    for start in range(split * BLOCK, kc, NSPLIT * BLOCK):
        slots = start + tl.arange(0, BLOCK)
        ok = slots < kc
        pos = tl.load(cand_ptr + b * sc_b + h * sc_h + slots, mask=ok, other=0)
        real = ok & (pos >= 0)  # -1: a carried row's padding (kernels/carry.py), stored as -inf
        keys = tl.load(kbase + pos.to(tl.int64)[:, None] * sk_n + offs_d[None, :], mask=real[:, None], other=0.0)
        s = _dot(q, keys, IEEE) * scale
        s = tl.where(real[None, :], s, float("-inf"))
        tl.store(logit_ptr + (r * G + offs_g[:, None]).to(tl.int64) * KC + slots[None, :], s,
                 mask=gmask[:, None] & ok[None, :])
        m_new = tl.maximum(m_i, tl.max(s, 1))
        l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(s - m_new[:, None]), 1)
        m_i = m_new
    if split == 0:  # the sinks and the recent window join every head's normalizer
        lo = tl.load(lo_ptr + b)
        hi = tl.load(hi_ptr + b)
        n = tl.load(n_ptr + b)
        j = tl.arange(0, OB)
        pos = tl.where(j < SINKS, j, hi + j - SINKS)
        ok = tl.where(j < SINKS, j < lo, (j < SINKS + RECENT) & (pos < n))
        keys = tl.load(kbase + pos.to(tl.int64)[:, None] * sk_n + offs_d[None, :], mask=ok[:, None], other=0.0)
        s = tl.where(ok[None, :], _dot(q, keys, IEEE) * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(s - m_new[:, None]), 1)
        m_i = m_new
    part = part_ptr + ((r * NSPLIT + split) * GP + offs_g) * 2
    tl.store(part, m_i)
    tl.store(part + 1, l_i)


@triton.jit
def _dot(q, keys, IEEE: tl.constexpr):
    """q [GP, D] . keys [BLOCK, D]^T in fp32: exact fp32 products where IEEE (fp32 inputs, and
    under the CPU interpreter, whose bf16 tl.dot is wrong), else one bf16 MMA."""
    if IEEE:
        return tl.dot(q.to(tl.float32), tl.trans(keys.to(tl.float32)), input_precision="ieee")
    return tl.dot(q, tl.trans(keys))


# KC is not specialized: where Triton knew it divisible by 16 (a 127,424-token slot: KC 25,488) it
# vectorized the logits' loads into a layout whose fp16 conversion LLVM cannot select ("Cannot
# select: v2f16 = scalar_to_vector", H100, Triton 3.6), and the abort took the server down
@triton.jit(do_not_specialize=["KC"])
def _score_kernel(logit_ptr, part_ptr, kc_ptr, k_ptr, key_ptr, ws_ptr, HKV, KC, KCP, NSPLIT, PSPLIT, sws_r,
                  G: tl.constexpr, GP: tl.constexpr, SP: tl.constexpr, BLOCK: tl.constexpr, KEY16: tl.constexpr,
                  LOG2: tl.constexpr, USE_PDL: tl.constexpr):
    r = tl.program_id(0)
    split = tl.program_id(1)
    kc = tl.load(kc_ptr + r // HKV)
    k = tl.load(k_ptr + r // HKV)
    pdl_enter(USE_PDL)  # the logits and their partial sums need the wait
    offs_g = tl.arange(0, GP)
    offs_s = tl.arange(0, SP)
    gmask = offs_g < G
    part = part_ptr + ((r * PSPLIT + offs_s[:, None]) * GP + offs_g[None, :]) * 2
    smask = (offs_s < PSPLIT)[:, None] & gmask[None, :]  # the attention's partials skip the padding heads
    pm = tl.load(part, mask=smask, other=NEG)
    pl = tl.load(part + 1, mask=smask, other=0.0)
    m = tl.max(pm, 0)
    z = tl.sum(pl * _exp(pm - m[None, :], LOG2), 0)
    inv = tl.where(gmask, 1.0 / tl.maximum(z, 1e-30), 0.0)
    # radix pass 0 of this program's keys, added to the row's histogram once at the end: one
    # flush of 256 bins per block made the scores' launch ~30 us a layer at 32K x 8 (H100)
    hist = tl.zeros([256], dtype=tl.int32)
    for start in range(split * BLOCK, KCP, NSPLIT * BLOCK):  # as many programs per row as the logits'
        slots = start + tl.arange(0, BLOCK)
        ok = slots < kc
        lg = tl.load(logit_ptr + (r * G + offs_g[:, None]).to(tl.int64) * KC + slots[None, :],
                     mask=gmask[:, None] & ok[None, :] & (slots < KC)[None, :], other=float("-inf"))
        score = tl.sum(_exp(lg - m[:, None], LOG2) * inv[:, None], 0)
        # padding (every logit -inf) ranks below every candidate, even one whose probability underflows
        real = ok & (tl.max(lg, 0) > float("-inf"))
        if not KEY16:  # fp32 scores for the four-pass radix: the reference's exact order
            tl.store(key_ptr + r.to(tl.int64) * KCP + slots, tl.where(real, score, -1.0))
        else:
            key = tl.where(real, _keys16(tl.log2(tl.maximum(score, 1e-38))), 0)
            tl.store(key_ptr + r.to(tl.int64) * KCP + slots, key)
            hist += tl.histogram((key >> 8).to(tl.int32), 256, mask=ok & (k > 0))
    if KEY16:
        bins = tl.arange(0, 256)
        tl.atomic_add(ws_ptr + r * sws_r + bins, hist, mask=hist > 0, sem="relaxed")


@triton.jit
def _exp(x, LOG2: tl.constexpr):
    """e^x, or 2^x for logits in log2 units (carried_attention's)."""
    if LOG2:
        return tl.exp2(x)
    return tl.exp(x)


class Reranker:
    """The re-rank of a fixed batch shape with its buffers (static, so a graph can hold it):
    batch rows x n_kv KV heads, `group` query heads per KV head, up to kc_max candidates and
    k_max kept keys per row."""

    def __init__(self, batch: int, n_kv: int, group: int, kc_max: int, k_max: int, device: torch.device | str,
                 programs: int = 264, key16: bool | None = None, follow: int = 0, pdl: bool = False) -> None:
        """key16: rank by 16-bit keys (None: for bf16 / fp16 queries in GQA groups of 4; False: fp32
        scores always). Why groups of 4: with 2 or 3 query heads a group (random:tiny, SmolLM2's
        shapes) Triton 3.6 failed to compile the 16-bit score kernel on the H100 (LLVM "Cannot
        select v2f16 scalar_to_vector") and the abort took the process down; 4 (Llama-3.1-8B) is
        what the 16-bit path was measured and tested at. pdl: the 16-bit path's launches are
        programmatic dependent ones (sync.py), as the selector's."""
        rows = batch * n_kv
        self.key16, self.pdl = key16, pdl
        self.group, self.kc_max = group, kc_max
        self.gp = max(16, triton.next_power_of_2(group))  # MMA rows
        self.rows, self.programs, self.device = rows, programs, device
        # 8 rows (batch 1): 256 slots a step, 26.5 vs 27.8 us the re-rank a layer at 32K, 46.1 vs 46.9 at 124K;
        # at 32K x 8 and 124K x 4, 128 stays best (65.4 vs 67.7, 101.8 vs 104.0; H200, bench shapes, a49a4b5)
        self.set_logits_shape(256 if rows <= 8 else BLOCK, 4)
        self.logits = torch.empty(rows, group, kc_max, device=device)
        self.kcp = triton.cdiv(kc_max, SCORE_BLOCK) * SCORE_BLOCK  # key rows padded: score programs store whole blocks
        self.keys16 = torch.zeros(batch, n_kv, self.kcp, dtype=torch.uint16, device=device)
        self.scores = torch.zeros(batch, n_kv, self.kcp, device=device)  # fp32 inputs: exact ranking
        self.slots = torch.zeros(batch, n_kv, k_max, dtype=torch.int32, device=device)
        # keys per program of the pair Top-K: 1024 against 4096 (H200, the whole re-rank a layer,
        # graph replay, same sets): 32K x 8 68.7 vs 71.8 us, 32K x 1 30.5 vs 34.2, 124K x 4 105.7
        # vs 109.5, 128K x 8 185.2 vs 188.4; more logits splits (32, 52) were slower everywhere.
        # The CPU interpreter pays per program, so it keeps 4096 (test_gpu_runner 219 vs 244 s);
        # test_topk_pair covers blocks of 256 and 512 there
        self.topk_block = 4096 if INTERPRET else 1024
        # the kept keys' Top-K workspace, then follow's (one zeroing for both)
        self.ws_pair = workspace(rows * (2 if follow else 1), device, blocks16(self.kcp, self.topk_block))
        self.ws = self.ws_pair[:rows]
        self.zero = torch.zeros(batch, dtype=torch.int32, device=device)
        self.positions = torch.zeros(batch, n_kv, k_max, dtype=torch.int32, device=device)
        # follow: the best candidates' slots (fp32 ranking), and a workspace for their Top-K
        self.follow_slots = torch.zeros(batch, n_kv, follow, dtype=torch.int32, device=device) if follow else None
        self.follow_ws = self.ws_pair[rows:] if follow else None
        self.zeroed_before = False  # adopt_workspace: the caller zeroes ws_pair before each call

    def adopt_workspace(self, ws_pair: torch.Tensor) -> None:
        """Use ws_pair (ws_pair's shape, int32) as the workspace; whoever passes it zeroes it
        before each call (GpuSelector.zero_with_route: its route launch)."""
        if ws_pair.shape != self.ws_pair.shape or ws_pair.dtype != torch.int32:
            raise ValueError(f"workspace {tuple(ws_pair.shape)} {ws_pair.dtype} must be "
                             f"{tuple(self.ws_pair.shape)} int32")
        self.ws_pair, self.ws = ws_pair, ws_pair[:self.rows]
        self.follow_ws = ws_pair[self.rows:] if self.follow_ws is not None else None
        self.zeroed_before = True

    def set_logits_shape(self, block: int, num_warps: int) -> None:
        """Candidate slots per inner step and warps of the logits programs (`bench shapes` sweeps
        them); the splits follow: ~2 waves of programs on 132 SMs, and at least MIN_SPLITS per
        row: at 32K x 8 (64 rows) 4 splits left the gathers latency-bound (H200, per layer:
        re-rank 77.3 us at 4 splits, 72.8 at 8, 71.2 at 16); batch 1 keeps its 33 (52 took 37.1
        us against 34.6)."""
        self.logits_block, self.logits_warps = block, num_warps
        self.splits = max(1, min(triton.cdiv(self.kc_max, block), max(self.programs // self.rows, MIN_SPLITS)))
        self.part = torch.empty(self.rows, self.splits, self.gp, 2, device=self.device)

    def __call__(self, q: torch.Tensor, keys: torch.Tensor, cand: torch.Tensor, kc: torch.Tensor, k: torch.Tensor,
                 lo: torch.Tensor, hi: torch.Tensor, n: torch.Tensor, sinks: int, recent: int,
                 follow_out: torch.Tensor | None = None, kf: torch.Tensor | None = None,
                 positions: torch.Tensor | None = None) -> torch.Tensor:
        """q [B, Hq, D], keys [B, Hkv, L, D] (stride 1 in D), cand [B, Hkv, >= kc_max] int32
        (-1: padding, never kept while k real candidates remain), kc, k, lo, hi, n [B] int32 ->
        key positions [B, Hkv, k_max] int32 (row b: its first k[b]), in `positions` where given
        (contiguous; reselect keeps each layer's there for the next step).
        follow_out [B, Hkv, F] int32 (with kf [B] int32 <= min(F, k)): gets row b's kf[b] best
        candidates' positions, in any order, then -1."""
        b, hkv, _, d = keys.shape
        rows = b * hkv
        ob = max(16, triton.next_power_of_2(sinks + recent))
        _logits_kernel[(rows, self.splits)](
            q, keys, cand, kc, lo, hi, n, self.logits, self.part, hkv, self.kc_max, self.splits,
            q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), keys.stride(2), cand.stride(0), cand.stride(1),
            d ** -0.5, G=self.group, GP=self.gp, D=d, BLOCK=self.logits_block, SINKS=sinks, RECENT=recent, OB=ob,
            IEEE=q.dtype == torch.float32 or INTERPRET, USE_PDL=self.pdl, num_warps=self.logits_warps,
            **launch_opts(self.pdl))
        return self.rank(q.dtype, cand, kc, k, self.part, self.splits, False, follow_out, kf, positions)

    def rank(self, dtype: torch.dtype, cand: torch.Tensor, kc: torch.Tensor, k: torch.Tensor, part: torch.Tensor,
             part_splits: int, log2: bool, follow_out: torch.Tensor | None = None, kf: torch.Tensor | None = None,
             positions: torch.Tensor | None = None) -> torch.Tensor:
        """The scores and Top-Ks of __call__ from self.logits as something wrote them: its logits
        launch (part = self.part), or carried_attention (log2 units; part: its workspace's
        (max, sum) pairs, part_splits programs a row). dtype: the queries'."""
        # bf16 / fp16 models rank by 16-bit keys (two radix launches; near-ties within ~0.3% may
        # swap, as bf16 products already may); fp32 ones by fp32 scores, as the reference ranks
        key16 = (dtype != torch.float32 and self.group % 4 == 0) if self.key16 is None else self.key16
        out = self.keys16 if key16 else self.scores
        if not self.zeroed_before:  # the score kernel adds radix pass 0 into ws (16-bit keys)
            self.ws_pair.zero_()
        _score_kernel[(self.rows, self.splits)](
            self.logits, part, kc, k, out, self.ws, self.rows // kc.shape[0], self.kc_max, self.kcp, self.splits,
            part_splits, self.ws.stride(0), G=self.group, GP=self.gp, SP=triton.next_power_of_2(part_splits),
            BLOCK=SCORE_BLOCK, KEY16=key16, LOG2=log2, USE_PDL=self.pdl, num_warps=4, **launch_opts(self.pdl))
        if follow_out is not None and (self.follow_slots is None or kf is None):
            raise ValueError("follow_out needs a Reranker built with follow > 0 and kf")
        if key16:  # both Top-Ks in two launches, candidate slots mapped to key positions in them
            follows = follow_out is not None
            kept = self.positions if positions is None else positions
            radix_topk_pair(out, self.zero, kc, k, kept, self.ws, cand, kf if follows else None,
                            follow_out, self.follow_ws, block=self.topk_block, pdl=self.pdl)
            return kept
        if follow_out is not None:
            radix_topk(out, self.zero, kc, kf, self.follow_slots, self.follow_ws, block=self.topk_block)
            write_follow(cand, self.follow_slots, kf, follow_out)
        radix_topk(out, self.zero, kc, k, self.slots, self.ws, block=self.topk_block)
        kept = torch.gather(cand[:, :, :self.kc_max], 2, self.slots.long())
        return kept if positions is None else positions.copy_(kept)
