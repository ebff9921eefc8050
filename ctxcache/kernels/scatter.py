"""Gather the routed lists and reduce by key into a dense accumulator (scatter-add).

For each row b, KV head h and subspace j, every query head g of the group adds
w[b, g, j] * (list_score - list_floor) (relative scoring; raw scores for absolute) at the
list's key indices into acc[b, h, :]. Query heads of a group that chose the same centroid
are merged first (weights summed), so a list is read once per group: the group-summed
ranking (group_combine="sum") is unchanged and shared lists cost no extra traffic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def scatter_ref(ids: torch.Tensor, w: torch.Tensor, list_idx: torch.Tensor, list_score: torch.Tensor,
                list_floor: torch.Tensor, n: int, relative: bool = True) -> torch.Tensor:
    """Torch reference (CSAttention.estimate summed over the group). ids, w [B, Hq, m];
    tables [B, Hkv, m, C, L] / floor [B, Hkv, m, C] -> acc [B, Hkv, n] fp32."""
    b, hq, m = ids.shape
    hkv = list_idx.shape[1]
    g = hq // hkv
    ids4 = ids.view(b, hkv, g, m).long()
    bb = torch.arange(b, device=ids.device)[:, None, None, None]
    hh = torch.arange(hkv, device=ids.device)[None, :, None, None]
    mm = torch.arange(m, device=ids.device)[None, None, None, :]
    idx = list_idx[bb, hh, mm, ids4].long()  # [B, Hkv, G, m, L]
    val = list_score[bb, hh, mm, ids4].float()
    if relative:
        val = val - list_floor[bb, hh, mm, ids4].float()[..., None]
    val = val * w.view(b, hkv, g, m, 1)
    acc = torch.zeros(b, hkv, n, device=ids.device)
    return acc.scatter_add_(2, idx.flatten(2), val.flatten(2))


@triton.jit
def _scatter_kernel(ids_ptr, w_ptr, idx_ptr, score_ptr, floor_ptr, acc_ptr,
                    HQ, G, M, L, si_b, si_h,
                    st_b, st_h, st_m, st_c, sf_b, sf_h, sf_m, sa_b, sa_h,
                    RELATIVE: tl.constexpr, G_PAD: tl.constexpr, BLOCK_L: tl.constexpr):
    pid = tl.program_id(0)
    blk = tl.program_id(1)
    mm = pid % M
    h = (pid // M) % HQ
    b = pid // (M * HQ)
    hkv = h // G
    g = h % G
    offs_g = tl.arange(0, G_PAD)
    gmask = offs_g < G
    grp = ids_ptr + b * si_b + (hkv * G + offs_g) * si_h + mm
    grp_ids = tl.load(grp, mask=gmask, other=-1)
    grp_w = tl.load(w_ptr + b * si_b + (hkv * G + offs_g) * si_h + mm, mask=gmask, other=0.0)
    c = tl.load(ids_ptr + b * si_b + h * si_h + mm)
    same = (grp_ids == c) & gmask
    dup = tl.sum((same & (offs_g < g)).to(tl.int32), axis=0) > 0  # an earlier head owns this list
    weight = tl.sum(tl.where(same, grp_w, 0.0), axis=0)
    floor = tl.load(floor_ptr + b * sf_b + hkv * sf_h + mm * sf_m + c).to(tl.float32)
    offs = blk * BLOCK_L + tl.arange(0, BLOCK_L)
    mask = (offs < L) & (dup == 0)
    base = b.to(tl.int64) * st_b + hkv * st_h + mm * st_m + c.to(tl.int64) * st_c  # tables exceed 2^31 entries at batch 8 x 128K
    keys = tl.load(idx_ptr + base + offs, mask=mask, other=0)
    s = tl.load(score_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
    if RELATIVE:
        s = s - floor
    tl.atomic_add(acc_ptr + b * sa_b + hkv * sa_h + keys, s * weight, mask=mask, sem="relaxed")


def scatter_lists(ids: torch.Tensor, w: torch.Tensor, list_idx: torch.Tensor, list_score: torch.Tensor,
                  list_floor: torch.Tensor, acc: torch.Tensor, relative: bool = True,
                  block_l: int = 1024) -> torch.Tensor:
    """Add the routed lists into acc [B, Hkv, N] fp32 (zero it first; not cleared here)."""
    b, hq, m = ids.shape
    _, hkv, m2, c, l = list_idx.shape
    if m2 != m or hq % hkv or list_score.shape != list_idx.shape or list_floor.shape != list_idx.shape[:4]:
        raise ValueError(f"ids {tuple(ids.shape)}, list_idx {tuple(list_idx.shape)}, list_score "
                         f"{tuple(list_score.shape)}, list_floor {tuple(list_floor.shape)} disagree")
    if list_idx.stride() != list_score.stride() or list_idx.stride(4) != 1:
        raise ValueError("list_idx and list_score need equal strides and a contiguous last dim")
    if acc.dtype != torch.float32 or acc.shape[:2] != (b, hkv) or acc.stride(2) != 1:
        raise ValueError(f"acc {tuple(acc.shape)} {acc.dtype} must be fp32 [{b}, {hkv}, N], contiguous in N")
    if not (ids.is_contiguous() and w.is_contiguous()):
        raise ValueError("ids and w must be contiguous")
    g = hq // hkv
    st, sf = list_idx.stride(), list_floor.stride()
    grid = (b * hq * m, triton.cdiv(l, block_l))
    _scatter_kernel[grid](ids, w, list_idx, list_score, list_floor, acc, hq, g, m, l,
                          ids.stride(0), ids.stride(1), st[0], st[1], st[2], st[3],
                          sf[0], sf[1], sf[2], acc.stride(0), acc.stride(1),
                          RELATIVE=relative, G_PAD=max(2, triton.next_power_of_2(g)), BLOCK_L=block_l)
    return acc
