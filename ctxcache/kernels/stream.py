"""Streaming insert of generated keys, and their contribution to the selection scores.

A key generated during decode is scored against every centroid of its KV head (m x C dots)
and the scores are written to column t of a per-stream overlay new_scores [B, Hkv, m, C, T]
(the shared tables stay read-only, as in CSAttention.append). At selection time a key counts
for a routed centroid only where it beats that list's floor (the paper's try-insert
condition), exactly like CSAttention._add_streamed."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ctxcache.kernels.sync import launch_opts, pdl_enter


def stream_scores_ref(k_new: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """k_new [B, Hkv, D], centroids [B, Hkv, m, C, d_b] -> scores [B, Hkv, m, C] fp32."""
    b, hkv, d = k_new.shape
    m = centroids.shape[2]
    return torch.einsum("bhmcd,bhmd->bhmc", centroids.float(), k_new.float().view(b, hkv, m, d // m))


def add_streamed_ref(ids, w, new_scores, list_floor, count, start, acc, offset=None) -> torch.Tensor:
    """acc[b, h, start[b] + t] += sum_{g, j} w * (s - offset) where s = new_scores[b, h, j, ids, t]
    beats the list floor, for t < count[b]; offset [B, Hkv, m, C] (None: the floor itself)."""
    offset = list_floor if offset is None else offset
    b, hq, m = ids.shape
    hkv = new_scores.shape[1]
    g = hq // hkv
    for r in range(b):
        cnt, s0 = int(count[r]), int(start[r])
        if cnt == 0:
            continue
        idv = ids[r].view(hkv, g, m).long()
        hh = torch.arange(hkv)[:, None, None]
        mm = torch.arange(m)[None, None, :]
        s = new_scores[r][hh, mm, idv][..., :cnt].float()  # [Hkv, G, m, T]
        fl = list_floor[r][hh, mm, idv].float()[..., None]
        off = offset[r][hh, mm, idv].float()[..., None]
        gain = torch.where(s > fl, s - off, torch.zeros_like(s))
        acc[r, :, s0:s0 + cnt] += (gain * w[r].view(hkv, g, m, 1)).sum((1, 2))
    return acc


@triton.jit
def _insert_kernel(k_ptr, perm_ptr, pos_ptr, start_ptr, count_ptr, c_ptr, out_ptr, HKV, M, C, DB,
                   sk_b, sk_h, sk_s, sc_b, sc_h, sc_m, sc_c, so_b, so_h, so_m, so_c,
                   BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr, PERM: tl.constexpr, USE_PDL: tl.constexpr):
    pid = tl.program_id(0)
    mm = pid % M
    h = (pid // M) % HKV
    b = pid // (M * HKV)
    offs_c = tl.arange(0, BLOCK_C)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < DB
    pos = tl.load(pos_ptr + b)
    col = pos - tl.load(start_ptr + b)
    dims = mm * DB + offs_d
    if PERM:  # subspace j holds head dims perm[j * DB : (j + 1) * DB]
        dims = tl.load(perm_ptr + dims, mask=dmask, other=0)
    cent = tl.load(c_ptr + b * sc_b + h * sc_h + mm * sc_m + offs_c[:, None] * sc_c + offs_d[None, :],
                   mask=(offs_c[:, None] < C) & dmask[None, :], other=0.0).to(tl.float32)
    pdl_enter(USE_PDL)  # positions and centroids came before the step; the new key needs the wait
    kb = tl.load(k_ptr + b.to(tl.int64) * sk_b + h * sk_h + pos.to(tl.int64) * sk_s + dims, mask=dmask,
                 other=0.0).to(tl.float32)
    dots = tl.sum(cent * kb[None, :], axis=1)
    tl.store(out_ptr + b * so_b + h * so_h + mm * so_m + offs_c * so_c + col, dots, mask=offs_c < C)
    if (h == 0) & (mm == 0):  # one program per row extends the row's streamed count
        tl.store(count_ptr + b, tl.maximum(tl.load(count_ptr + b), col + 1))


def stream_insert(k: torch.Tensor, centroids: torch.Tensor, new_scores: torch.Tensor, pos: torch.Tensor,
                  start: torch.Tensor, count: torch.Tensor, perm: torch.Tensor | None = None,
                  pdl: bool = False) -> None:
    """Index the key at position pos[b] of each row into column pos[b] - start[b] of
    new_scores, and raise count[b] to cover it (pos, start, count int32 [B]; one launch, so a
    captured decode step pays one kernel per layer for it). k is the new keys [B, Hkv, D], or a
    layer's cache [B, Hkv, S, D] whose row pos[b] holds the key (no gather launch first).
    perm [D] (int): the subspace layout's dim order (None: contiguous subspaces). pdl: a programmatic
    dependent launch (sync.py: pos, start and the centroids are read before the wait)."""
    b, hkv, d = k.shape[0], k.shape[1], k.shape[-1]
    _, hkv2, m, c, db = centroids.shape
    if (k.dim() not in (3, 4) or hkv2 != hkv or m * db != d or new_scores.shape[:4] != (b, hkv, m, c)
            or new_scores.dtype != torch.float32):
        raise ValueError(f"k {tuple(k.shape)}, centroids {tuple(centroids.shape)}, "
                         f"new_scores {tuple(new_scores.shape)} {new_scores.dtype} disagree")
    if k.stride(-1) != 1 or centroids.stride(4) != 1 or new_scores.stride(4) != 1:
        raise ValueError("k, centroids and new_scores need a contiguous last dimension")
    for name, t in (("pos", pos), ("start", start), ("count", count)):
        if t.shape != (b,) or t.dtype != torch.int32 or not t.is_contiguous():
            raise ValueError(f"{name} {tuple(t.shape)} {t.dtype} must be contiguous int32 [{b}]")
    if perm is not None and perm.shape != (d,):
        raise ValueError(f"perm {tuple(perm.shape)} must be [{d}]")
    sc, so = centroids.stride(), new_scores.stride()
    _insert_kernel[(b * hkv * m,)](k, perm if perm is not None else pos, pos, start, count, centroids, new_scores,
                                   hkv, m, c, db, k.stride(0), k.stride(1), k.stride(2) if k.dim() == 4 else 0,
                                   sc[0], sc[1], sc[2], sc[3], so[0], so[1], so[2], so[3],
                                   BLOCK_C=triton.next_power_of_2(c), BLOCK_D=max(16, triton.next_power_of_2(db)),
                                   PERM=perm is not None, USE_PDL=pdl, **launch_opts(pdl))


@triton.jit(do_not_specialize=["T", "col"])
def _span_kernel(k_ptr, perm_ptr, c_ptr, out_ptr, real_ptr, count_ptr, T, col, M, C, DB, sk_h, sk_t,
                 sc_h, sc_m, sc_c, so_h, so_m, so_c, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_T: tl.constexpr, PERM: tl.constexpr):
    pid, blk = tl.program_id(0), tl.program_id(1)
    h, mm = pid // M, pid % M
    offs_c, offs_d = tl.arange(0, BLOCK_C), tl.arange(0, BLOCK_D)
    t = blk * BLOCK_T + tl.arange(0, BLOCK_T)
    dmask = offs_d < DB
    dims = mm * DB + offs_d
    if PERM:  # subspace j holds head dims perm[j * DB : (j + 1) * DB]
        dims = tl.load(perm_ptr + dims, mask=dmask, other=0)
    cent = tl.load(c_ptr + h * sc_h + mm * sc_m + offs_c[:, None] * sc_c + offs_d[None, :],
                   mask=(offs_c[:, None] < C) & dmask[None, :], other=0.0).to(tl.float32)
    keys = tl.load(k_ptr + h * sk_h + t[:, None] * sk_t + dims[None, :], mask=(t[:, None] < T) & dmask[None, :],
                   other=0.0).to(tl.float32)
    # [C, T]: each dot summed over the subspace's dims as _insert_kernel sums a decoded key's
    dots = tl.sum(cent[:, None, :] * keys[None, :, :], axis=2)
    tl.store(out_ptr + h * so_h + mm * so_m + offs_c[:, None] * so_c + col + t[None, :], dots,
             mask=(offs_c[:, None] < C) & (t[None, :] < T))
    if (pid == 0) & (blk == 0):  # the row's streamed count covers the span's real keys
        tl.store(count_ptr, tl.maximum(tl.load(count_ptr), tl.load(real_ptr) + col))


def span_insert(keys: torch.Tensor, centroids: torch.Tensor, new_scores: torch.Tensor, col: int,
                count: torch.Tensor, real: torch.Tensor, perm: torch.Tensor | None = None) -> None:
    """One row's span of keys [Hkv, T, D] (a prompt's) scored against its centroids [Hkv, m, C,
    d_b] into columns col..col+T-1 of its overlay new_scores [Hkv, m, C, T_max] fp32 (as
    stream_insert scores one key), and count (int32 [1]) raised to real + col (real int32 [1]:
    the span's real keys, the rest pad it). One launch; stream_scores_ref per key is the reference."""
    hkv, t, d = keys.shape
    _, m, c, db = centroids.shape
    if (centroids.shape[0] != hkv or m * db != d or new_scores.shape[:3] != (hkv, m, c)
            or new_scores.dtype != torch.float32 or col + t > new_scores.shape[3]):
        raise ValueError(f"keys {tuple(keys.shape)} at column {col}, centroids {tuple(centroids.shape)}, "
                         f"new_scores {tuple(new_scores.shape)} {new_scores.dtype} disagree")
    if keys.stride(-1) != 1 or centroids.stride(3) != 1 or new_scores.stride(3) != 1:
        raise ValueError("keys, centroids and new_scores need a contiguous last dimension")
    if t == 0:
        return
    sc, so, block_t = centroids.stride(), new_scores.stride(), 32
    _span_kernel[(hkv * m, triton.cdiv(t, block_t))](
        keys, perm if perm is not None else real, centroids, new_scores, real, count, t, col, m, c, db,
        keys.stride(0), keys.stride(1), sc[0], sc[1], sc[2], so[0], so[1], so[2],
        BLOCK_C=triton.next_power_of_2(c), BLOCK_D=max(16, triton.next_power_of_2(db)), BLOCK_T=block_t,
        PERM=perm is not None)


@triton.jit
def _add_kernel(ids_ptr, w_ptr, ns_ptr, floor_ptr, off_ptr, cnt_ptr, start_ptr, acc_ptr, HKV, G, M,
                si_b, si_h, sn_b, sn_h, sn_m, sn_c, sf_b, sf_h, sf_m, sa_b, sa_h,
                BLOCK_T: tl.constexpr):
    row = tl.program_id(0)
    blk = tl.program_id(1)
    b = row // HKV
    h = row % HKV
    cnt = tl.load(cnt_ptr + b)
    s0 = tl.load(start_ptr + b)
    offs = blk * BLOCK_T + tl.arange(0, BLOCK_T)
    mask = offs < cnt
    total = tl.zeros((BLOCK_T,), tl.float32)
    for g in range(G):
        for mm in range(M):
            c = tl.load(ids_ptr + b * si_b + (h * G + g) * si_h + mm)
            w = tl.load(w_ptr + b * si_b + (h * G + g) * si_h + mm)
            fl = tl.load(floor_ptr + b * sf_b + h * sf_h + mm * sf_m + c).to(tl.float32)
            off = tl.load(off_ptr + b * sf_b + h * sf_h + mm * sf_m + c).to(tl.float32)
            s = tl.load(ns_ptr + b * sn_b + h * sn_h + mm * sn_m + c * sn_c + offs, mask=mask, other=0.0)
            total += tl.where(s > fl, s - off, 0.0) * w
    ptr = acc_ptr + b * sa_b + h * sa_h + s0 + offs
    tl.store(ptr, tl.load(ptr, mask=mask, other=0.0) + total, mask=mask)


def add_streamed(ids, w, new_scores, list_floor, count, start, acc, offset=None,
                 block_t: int = 128) -> torch.Tensor:
    """Add streamed keys' gains into acc [B, Hkv, N] (after scatter_lists, same stream).
    offset [B, Hkv, m, C] is what is subtracted from a winning score (None: the floor)."""
    offset = list_floor if offset is None else offset
    if offset.shape != list_floor.shape or offset.stride() != list_floor.stride():
        raise ValueError(f"offset {tuple(offset.shape)} must match list_floor {tuple(list_floor.shape)} and its strides")
    b, hq, m = ids.shape
    hkv, t_max = new_scores.shape[1], new_scores.shape[4]
    if new_scores.shape[:3] != (b, hkv, m) or list_floor.shape[:3] != (b, hkv, m) or new_scores.stride(4) != 1:
        raise ValueError(f"ids {tuple(ids.shape)}, new_scores {tuple(new_scores.shape)}, "
                         f"list_floor {tuple(list_floor.shape)} disagree")
    if count.dtype != torch.int32 or start.dtype != torch.int32 or acc.stride(2) != 1:
        raise ValueError("count and start must be int32 [B]; acc contiguous in N")
    sn, sf = new_scores.stride(), list_floor.stride()
    _add_kernel[(b * hkv, triton.cdiv(t_max, block_t))](
        ids, w, new_scores, list_floor, offset, count, start, acc, hkv, hq // hkv, m,
        ids.stride(0), ids.stride(1), sn[0], sn[1], sn[2], sn[3], sf[0], sf[1], sf[2],
        acc.stride(0), acc.stride(1), BLOCK_T=block_t)
    return acc
