"""The whole CSAttention selection of a few rows in one launch: route, int8 scores, exact Top-K.

Why: at batch 1 (8 rows of 128K keys, Llama-3.1-8B shapes) the selection is four dependent
launches (route -> dense_dot8 -> radix pass 1 -> collect) that each move little: the chain
costs ~16 us of a ~39 us step for an 8 MB table read (H100, bench/README.md). Here P programs
per row, all resident at once, each own one chunk of the row's keys and keep its 16-bit keys
in registers; the radix passes' row-wide joins become two row barriers (a spin on an arrival
counter) instead of launch boundaries:

1. every program routes its row's group query (the G heads summed per subspace, argmax over
   the C centroids, weight ||q_j||: route.py's arithmetic), quantizes the weights and scores
   its chunk by dp4a (dense_dot8's arithmetic, so the same keys), and stores its chunk's
   histogram of the keys' top byte in its own slot; barrier;
2. sums the row's P histograms and walks them to the K-th key's top byte b0; stores its
   candidates' (top byte == b0) low-byte histogram in its slot; barrier;
3. walks the summed low-byte histogram to the threshold key T and writes its keys above T
   and its share of the ties at positions counted from the earlier programs' slots: keys
   above T by index, then ties (the lowest indices, as radix_topk) by index.

Residency: the barrier needs every program of the launch running at once. One program always
fits on an idle SM, so the launcher keeps rows x P <= the SM count; earlier kernels finish on
their own, and with PDL this kernel's successor launches only after all its programs started.
(A concurrent kernel that never finishes would stall it: not a case this decoder has.)
Slots are overwritten every call and the counter only grows (compared wrap-safe), so nothing
is zeroed between calls. Under the CPU interpreter programs run one after another and a
barrier cannot be waited on: `phased` launches the three steps as three launches of the same
kernel, each recomputing the keys (the CPU tests' path, and a cross-check on the GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ctxcache.kernels.dense_dot8 import _dot4, _row_words
from ctxcache.kernels.dense_select import check_routed_inputs
from ctxcache.kernels.select16 import _walk256
from ctxcache.kernels.smem_hist import smem_hist_counts, smem_hist_declare
from ctxcache.kernels.sync import _fence, compiled, launch_opts, pdl_wait
from ctxcache.kernels.topk import _keys16

HEAD = 32  # per row: the arrival counter, padded to its own 128-byte line
SLOT = 512  # per program: its hist0 then its hist1
MAX_CHUNK = 8192  # keys per program held in registers (32 per thread at 8 warps)
_HEAD = tl.constexpr(HEAD)  # the same numbers as seen from inside kernels
_SLOT = tl.constexpr(SLOT)


@triton.jit
def _row_barrier(ctr_ptr, P: tl.constexpr, GPU: tl.constexpr):
    """Wait until all P programs of the row arrived; their earlier stores are then visible
    (release: fence + arrival; acquire: the polled value + fence). The counter grows by P per
    barrier, so this barrier ends at the next multiple of P above the arrival (wrap-safe)."""
    if GPU:
        _fence(GPU)
        tl.debug_barrier()  # every thread's stores are fenced before the one arrival
        old = tl.atomic_add(ctr_ptr, 1, sem="release", scope="gpu")
        target = (old & ~(P - 1)) + P
        cur = old + 1
        while target - cur > 0:
            cur = tl.load(ctr_ptr, volatile=True)
        _fence(GPU)


@triton.jit
def _route_group(q_ptr, cent, b, h, sq_b, sq_h, G: tl.constexpr, M: tl.constexpr, DB: tl.constexpr):
    """route.py (group=True) for KV head h: centroid ids [M] and weights ||q_j|| [M]."""
    offs_j = tl.arange(0, M)
    offs_d = tl.arange(0, DB)
    qb = tl.zeros((M, DB), tl.float32)
    for g in tl.static_range(G):  # in head order, as route.py sums them
        qb += tl.load(q_ptr + b * sq_b + (h * G + g) * sq_h + offs_j[:, None] * DB + offs_d[None, :]).to(tl.float32)
    dots = tl.sum(cent.to(tl.float32) * qb[:, None, :], axis=2)
    return tl.argmax(dots, axis=1).to(tl.int32), tl.sqrt(tl.sum(qb * qb, axis=1))


@triton.jit
def _pick(x, offs, r: tl.constexpr):
    """Element r of the small vector x as a scalar."""
    return tl.sum(tl.where(offs == r, x, 0), axis=0)


@triton.jit
def _chunk_keys(ids, w, ds_ptr, scale_ptr, ns_ptr, b, h, p, nctx, s0, cnt,
                sd_b, sd_h, sd_m, sd_c, ss_b, ss_h, ss_m, sn_b, sn_h, sn_m, sn_c,
                M: tl.constexpr, CH: tl.constexpr, ROW_EVICT: tl.constexpr, ASM: tl.constexpr):
    """dense_dot8's 16-bit keys of keys [p * CH, (p + 1) * CH) of row (b, h) for routed ids, w [M]."""
    offs_j = tl.arange(0, M)
    ws = w * tl.load(scale_ptr + b * ss_b + h * ss_h + offs_j * ss_m + ids)
    big = tl.max(tl.abs(ws), axis=0)
    e_bits = (big.to(tl.int32, bitcast=True) >> 23) & 0xFF
    ok = e_bits >= 7
    inv = tl.where(ok, (260 - e_bits) << 23, 0).to(tl.float32, bitcast=True)
    deq = tl.where(ok, (e_bits - 6) << 23, 0).to(tl.float32, bitcast=True)
    wq = tl.minimum(tl.maximum(tl.floor(ws * inv + 0.5), -127.0), 127.0).to(tl.int32)
    packed = (wq & 0xFF) << (8 * (offs_j % 4))  # disjoint bytes: the sum packs them

    QW: tl.constexpr = CH // 4
    words = p * QW + tl.arange(0, QW)
    in_load = words < (nctx + 15) // 16 * 4
    a0 = tl.zeros((QW,), tl.int32)
    a1 = tl.zeros((QW,), tl.int32)
    a2 = tl.zeros((QW,), tl.int32)
    a3 = tl.zeros((QW,), tl.int32)
    for r4 in tl.static_range(0, M, 4):
        wpack = tl.sum(tl.where(offs_j // 4 == r4 // 4, packed, 0), axis=0)
        x0 = _row_words(ds_ptr, _pick(ids, offs_j, r4), b, h, r4, M, sd_b, sd_h, sd_m, sd_c, words, in_load, ROW_EVICT)
        x1 = _row_words(ds_ptr, _pick(ids, offs_j, r4 + 1), b, h, r4 + 1, M, sd_b, sd_h, sd_m, sd_c, words, in_load,
                        ROW_EVICT)
        x2 = _row_words(ds_ptr, _pick(ids, offs_j, r4 + 2), b, h, r4 + 2, M, sd_b, sd_h, sd_m, sd_c, words, in_load,
                        ROW_EVICT)
        x3 = _row_words(ds_ptr, _pick(ids, offs_j, r4 + 3), b, h, r4 + 3, M, sd_b, sd_h, sd_m, sd_c, words, in_load,
                        ROW_EVICT)
        a0, a1, a2, a3 = _dot4(a0, a1, a2, a3, x0, x1, x2, x3, wpack + tl.zeros((QW,), tl.int32), ASM)
    isum = tl.reshape(tl.join(tl.join(a0, a2), tl.join(a1, a3)), (CH,))
    offs = p * CH + tl.arange(0, CH)
    acc = tl.where(offs < nctx, isum.to(tl.float32) * deq, 0.0)
    t = offs - s0
    if (cnt > 0) & (s0 < p * CH + CH) & (s0 + cnt > p * CH):  # the chunk holds streamed keys
        in_new = (t >= 0) & (t < cnt)
        for r in tl.static_range(M):  # in row order, as dense_dot8 adds them
            c = _pick(ids, offs_j, r)
            y = tl.load(ns_ptr + b * sn_b + h * sn_h + r * sn_m + c * sn_c + t, mask=in_new, other=0.0)
            acc += y * _pick(w, offs_j, r)
    return _keys16(acc).to(tl.int32), offs


@triton.jit
def _hist(digit, valid, dec, SMEM: tl.constexpr, CH: tl.constexpr):
    if SMEM:
        return smem_hist_counts(digit, valid, dec, CH)
    return tl.histogram(digit, 256, mask=valid)


@triton.jit
def _row_select_kernel(q_ptr, c_ptr, ds_ptr, scale_ptr, ns_ptr, nctx_ptr, start_ptr, cnt_ptr,
                       lo_ptr, hi_ptr, k_ptr, ids_ptr, w_ptr, ws_ptr, out_ptr,
                       sq_b, sq_h, sc_b, sc_h, sc_m, sc_c, sd_b, sd_h, sd_m, sd_c, ss_b, ss_h, ss_m,
                       sn_b, sn_h, sn_m, sn_c, sws_r, so_r,
                       HKV: tl.constexpr, G: tl.constexpr, M: tl.constexpr, C: tl.constexpr, DB: tl.constexpr,
                       P: tl.constexpr, CH: tl.constexpr, PHASE: tl.constexpr, ROUTE: tl.constexpr,
                       ASM: tl.constexpr, SMEM: tl.constexpr, GPU: tl.constexpr, USE_PDL: tl.constexpr,
                       ROW_EVICT: tl.constexpr):
    row = tl.program_id(0)
    p = tl.program_id(1)
    b = row // HKV
    h = row % HKV
    offs_j = tl.arange(0, M)
    if ROUTE:  # the centroids are static: loaded while the predecessor drains
        cent = tl.load(c_ptr + b * sc_b + h * sc_h + offs_j[:, None, None] * sc_m
                       + tl.arange(0, C)[None, :, None] * sc_c + tl.arange(0, DB)[None, None, :])
    pdl_wait(USE_PDL)
    if ROUTE:
        ids, w = _route_group(q_ptr, cent, b, h, sq_b, sq_h, G, M, DB)
        if p == 0:  # for inspection (the selector's ids / w buffers)
            tl.store(ids_ptr + row * M + offs_j, ids)
            tl.store(w_ptr + row * M + offs_j, w)
    else:  # routed by the caller (tests: the same scores as dense_dot8 bit for bit)
        ids = tl.load(ids_ptr + row * M + offs_j)
        w = tl.load(w_ptr + row * M + offs_j)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()  # every program is resident once all got here
    lo = tl.load(lo_ptr + b)
    hi = tl.load(hi_ptr + b)
    k = tl.load(k_ptr + b)
    key, offs = _chunk_keys(ids, w, ds_ptr, scale_ptr, ns_ptr, b, h, p, tl.load(nctx_ptr + b), tl.load(start_ptr + b),
                            tl.load(cnt_ptr + b), sd_b, sd_h, sd_m, sd_c, ss_b, ss_h, ss_m, sn_b, sn_h, sn_m, sn_c,
                            M, CH, ROW_EVICT, ASM)
    valid = (offs >= lo) & (offs < hi) & (k > 0)
    digit = key >> 8
    ws = ws_ptr + row * sws_r
    slot = ws + _HEAD + p * _SLOT
    bins = tl.arange(0, 256)
    dec = smem_hist_declare(p) if SMEM else p
    if PHASE <= 1:  # one launch (0) or its first step (1)
        tl.store(slot + bins, _hist(digit, valid, dec, SMEM, CH))
        _row_barrier(ws, P, GPU)
    if PHASE != 1:
        progs = tl.arange(0, P)
        h0_all = tl.load(ws + _HEAD + progs[:, None] * _SLOT + bins[None, :], cache_modifier=".cg")  # [P, 256]
        b0, g0 = _walk256(tl.sum(h0_all, axis=0), k, bins)
        before = progs < p
        above_before = tl.sum(tl.sum(tl.where(before[:, None] & (bins > b0)[None, :], h0_all, 0), axis=1), axis=0)
        low = key & 255
        if PHASE != 3:
            tl.store(slot + 256 + bins, _hist(low, valid & (digit == b0), dec, SMEM, CH))
            _row_barrier(ws, P, GPU)
        if PHASE != 2:
            h1_all = tl.load(ws + _HEAD + progs[:, None] * _SLOT + 256 + bins[None, :], cache_modifier=".cg")
            t1, g1 = _walk256(tl.sum(h1_all, axis=0), k - g0, bins)
            need_eq = k - g0 - g1
            h1_before = tl.where(before[:, None], h1_all, 0)
            win_before = above_before + tl.sum(tl.sum(tl.where((bins > t1)[None, :], h1_before, 0), axis=1), axis=0)
            ties_before = tl.sum(tl.sum(tl.where((bins == t1)[None, :], h1_before, 0), axis=1), axis=0)
            thresh = b0 * 256 + t1
            gt = valid & (key > thresh)
            eq = valid & (key == thresh)
            # both ranks in one scan, ties in the high half (a chunk holds fewer than 2^16 keys)
            rank = tl.cumsum(gt.to(tl.int32) + (eq.to(tl.int32) << 16), axis=0)
            out = out_ptr + row * so_r
            tl.store(out + win_before + (rank & 0xFFFF) - 1, offs, mask=gt)
            slot_eq = ties_before + (rank >> 16) - 1
            tl.store(out + (k - need_eq) + slot_eq, offs, mask=eq & (slot_eq < need_eq))


def row_select_ref(q: torch.Tensor, centroids: torch.Tensor, dense: torch.Tensor, scale: torch.Tensor,
                   new_scores: torch.Tensor, n_ctx: torch.Tensor, start: torch.Tensor, count: torch.Tensor,
                   lo: torch.Tensor, hi: torch.Tensor, k: torch.Tensor, n_pad: int) -> list[torch.Tensor]:
    """Torch reference: route_ref (group) -> dense_dot8_ref -> 16-bit keys -> topk16_ref; per
    (row, KV head) the selected indices, sorted."""
    from ctxcache.kernels.dense_dot8 import dense_dot8_ref
    from ctxcache.kernels.route import route_ref
    from ctxcache.kernels.topk import keys16_ref, topk16_ref

    ids, w = route_ref(q, centroids, group=True)
    keys = keys16_ref(dense_dot8_ref(ids, w, dense, scale, new_scores, n_ctx, start, count, n_pad))
    hkv = dense.shape[1]
    rows = keys.shape[0] * hkv
    per = lambda t: t.repeat_interleave(hkv)  # noqa: E731  (batch row -> its KV heads' rows)
    return topk16_ref(keys.reshape(rows, -1), per(lo), per(hi), per(k))


def resident_programs(rows: int, n_pad: int, sms: int, max_chunk: int = MAX_CHUNK) -> int:
    """Programs per row for row_select: the most (a power of two) with rows x P <= sms, so all
    are resident at once, and power-of-two chunks of n_pad / P keys; 0 when none fits in
    max_chunk keys (too many rows, or rows too long: use the multi-launch selection)."""
    p = 1
    while rows * p * 2 <= sms and n_pad % (p * 2) == 0 and n_pad // (p * 2) >= 256:
        p *= 2
    chunk = n_pad // p
    return p if n_pad % p == 0 and chunk <= max_chunk and chunk & (chunk - 1) == 0 else 0


def row_workspace(rows: int, programs: int, device: torch.device | str) -> torch.Tensor:
    """Per row: the arrival counter, then one slot per program. Zeroed once; row_select keeps it
    valid across calls (slots overwritten, the counter only grows)."""
    return torch.zeros(rows, HEAD + programs * SLOT, dtype=torch.int32, device=device)


def row_select(q: torch.Tensor, centroids: torch.Tensor, dense: torch.Tensor, scale: torch.Tensor,
               new_scores: torch.Tensor, n_ctx: torch.Tensor, start: torch.Tensor, count: torch.Tensor,
               lo: torch.Tensor, hi: torch.Tensor, k: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
               ws: torch.Tensor, out: torch.Tensor, n_pad: int, programs: int, routed: bool = False, phased: bool | None = None,
               pdl: bool = False, num_warps: int = 8, evict_first: bool = True) -> torch.Tensor:
    """q [B, Hq, D]; centroids [B, Hkv, m, C, d_b] (contiguous subspaces); dense int8
    [B, Hkv, m, C, N] with scale [B, Hkv, m, C]; new_scores, n_ctx, start, count, lo, hi, k as
    dense_dot8 -> out [B, Hkv, K_max] int32 with row (b, h)'s k[b] indices in out[b, h, :k[b]].
    ids int32 / w fp32 [B, Hkv, m]: the route's output (routed=True: the caller's route, read).
    ws: row_workspace(B * Hkv, programs). n_pad: the positions [0, n_pad) considered (it must
    cover hi: the table's N plus streamed keys), P = programs (resident_programs) chunks of
    n_pad / P keys, a power of two. phased: three launches instead of barriers (None:
    only where the code is not compiled, i.e. the CPU interpreter)."""
    if ids.shape != w.shape or ids.dim() != 3 or ids.dtype != torch.int32 or w.dtype != torch.float32:
        raise ValueError(f"ids {tuple(ids.shape)} {ids.dtype} / w {tuple(w.shape)} {w.dtype} must be int32 / fp32 "
                         "[B, Hkv, m]")
    check_routed_inputs(ids, w, dense, new_scores, n_ctx=n_ctx, start=start, count=count, lo=lo, hi=hi, k=k)
    b, hq, d = q.shape
    hkv, m, c, n = dense.shape[1:]
    db = centroids.shape[4]
    if centroids.shape[:4] != (b, hkv, m, c) or m * db != d or hq % hkv or q.stride(2) != 1 \
            or centroids.stride(4) != 1:
        raise ValueError(f"q {tuple(q.shape)} and centroids {tuple(centroids.shape)} do not match dense "
                         f"{tuple(dense.shape)} (contiguous last dims)")
    if any(x & (x - 1) for x in (m, c, db)):
        raise ValueError(f"m={m}, C={c}, d_b={db} must be powers of two")
    if dense.dtype != torch.int8 or scale.dtype != torch.float32 or scale.shape != dense.shape[:4] \
            or scale.stride(3) != 1:
        raise ValueError(f"dense {dense.dtype} must be int8 with an fp32 scale {tuple(dense.shape[:4])}")
    if n % 16 or any(s % 16 for s in dense.stride()[:4]):
        raise ValueError(f"dense rows must hold whole 16-key runs (N={n}, strides {dense.stride()})")
    if programs < 1 or programs & (programs - 1):
        raise ValueError(f"programs={programs} must be a power of two (resident_programs)")
    chunk = n_pad // programs
    if n_pad % programs or chunk < 16 or chunk & (chunk - 1) or chunk > MAX_CHUNK:
        raise ValueError(f"n_pad={n_pad} over {programs} programs must give a power-of-two chunk in [16, {MAX_CHUNK}]"
                         " (resident_programs)")
    rows = b * hkv
    if ws.shape != (rows, HEAD + programs * SLOT) or ws.dtype != torch.int32 or not ws.is_contiguous():
        raise ValueError(f"ws {tuple(ws.shape)} must be row_workspace({rows}, {programs})")
    if out.shape[:2] != (b, hkv) or out.dtype != torch.int32 or out.stride(2) != 1 \
            or out.stride(0) != hkv * out.stride(1):
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must be int32 [{b}, {hkv}, K_max]")
    if not (ids.is_contiguous() and w.is_contiguous()) or ids.shape != (b, hkv, m):
        raise ValueError(f"ids / w must be contiguous [{b}, {hkv}, {m}]")
    gpu = compiled(q)
    if phased is None:
        phased = not gpu
    if not phased and not gpu:
        raise ValueError("the one-launch form needs compiled GPU code (its barrier spins); pass phased=True")
    if not phased and torch.cuda.get_device_properties(q.device).multi_processor_count < rows * programs:
        raise ValueError(f"{rows} rows x {programs} programs cannot all be resident on this GPU")
    launch = row_select_launch(q, centroids, dense, scale, new_scores, n_ctx, start, count, lo, hi, k, ids, w, ws,
                               out, programs, chunk, routed, gpu, pdl, num_warps, evict_first)
    for phase in ((1, 2, 3) if phased else (0,)):
        launch(PHASE=phase)
    return out


def row_select_launch(q, centroids, dense, scale, new_scores, n_ctx, start, count, lo, hi, k, ids, w, ws, out,
                      programs: int, chunk: int, routed: bool, gpu: bool, pdl: bool, num_warps: int,
                      evict_first: bool):
    """The kernel launch with checked arguments, as a callable taking the remaining constexprs
    (PHASE; a probe may also override others, e.g. GPU=False to time it without the barriers)."""
    b, hq = q.shape[:2]
    hkv, m, c = dense.shape[1:4]
    words = dense.view(torch.int32)
    sd = [s // 4 for s in dense.stride()[:4]]
    sc, sn = centroids.stride(), new_scores.stride()
    args = (q, centroids, words, scale, new_scores, n_ctx, start, count, lo, hi, k, ids, w, ws, out,
            q.stride(0), q.stride(1), sc[0], sc[1], sc[2], sc[3], *sd, *scale.stride()[:3], *sn[:4],
            ws.stride(0), out.stride(1))
    consts = dict(HKV=hkv, G=hq // hkv, M=m, C=c, DB=centroids.shape[4], P=programs, CH=chunk, ROUTE=not routed,
                  ASM=gpu, SMEM=gpu, GPU=gpu, USE_PDL=pdl, ROW_EVICT="evict_first" if evict_first else "",
                  num_warps=num_warps, **launch_opts(pdl))

    def launch(**override):
        _row_select_kernel[(b * hkv, programs)](*args, **{**consts, **override})
    return launch
