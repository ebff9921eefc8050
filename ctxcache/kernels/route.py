"""Nearest centroid per subspace for every query head (and any leading rows) in one launch.

q [R, Hq, D] (subspaces contiguous: permute dims first for other layouts), centroids
[R, Hkv, m, C, d_b] (unit vectors, fp16; stride 0 on R shares one table) ->
ids [R, Hq, m] int32 (argmax cosine) and qnorm [R, Hq, m] fp32 (||q_b||, the qnorm weight).
Argmax of q_b . c equals argmax of cos(q_b, c) since ||q_b|| > 0 is shared by all c.
group=True routes the sum of each GQA group's query heads instead (CSAttention
routing="group"): ids and qnorm are then [R, Hkv, m].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ctxcache.kernels.sync import launch_opts, pdl_enter


def route_ref(q: torch.Tensor, centroids: torch.Tensor, group: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference matching CSAttention._route (tau = 1) and its qnorm weight."""
    r, hq, d = q.shape
    hkv, m = centroids.shape[1:3]
    sub = q.float().view(r, hkv, hq // hkv, m, d // m)  # [R, Hkv, G, m, d_b]
    if group:
        sub = sub.sum(2, keepdim=True)
    cos = torch.einsum("rhgmd,rhmcd->rhgmc", F.normalize(sub, dim=-1), centroids.float())
    ids = torch.topk(cos, 1, dim=-1).indices[..., 0]
    return ids.reshape(r, -1, m).int(), sub.norm(dim=-1).reshape(r, -1, m)


@triton.jit
def _route_kernel(q_ptr, c_ptr, ids_ptr, w_ptr, HO, G, M, C, DB,
                  sq_r, sq_h, sc_r, sc_h, sc_m, sc_c, so_r, so_h,
                  z_ptr, Z_PER, ZN, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr,
                  ZERO: tl.constexpr, Z_CHUNK: tl.constexpr, USE_PDL: tl.constexpr, PRE_WAIT: tl.constexpr = True):
    if not PRE_WAIT:
        pdl_enter(USE_PDL)
    pid = tl.program_id(0)
    mm = tl.program_id(1)
    r = pid // HO  # HO output heads per row: Hq, or Hkv when routing group sums
    h = pid % HO
    hkv = h if GROUP else h // G
    offs_d = tl.arange(0, BLOCK_D)
    offs_c = tl.arange(0, BLOCK_C)
    dmask = offs_d < DB
    cp = c_ptr + r * sc_r + hkv * sc_h + mm * sc_m + offs_c[:, None] * sc_c + offs_d[None, :]
    cent = tl.load(cp, mask=(offs_c[:, None] < C) & dmask[None, :], other=0.0).to(tl.float32)
    if PRE_WAIT:  # the centroids are static (sync.py): read while the predecessor drains; q waits
        pdl_enter(USE_PDL)
    if ZERO:  # side job: this program's share of a buffer the next kernels need zeroed
        z0 = (pid * M + mm) * Z_PER
        for s in range(z0, tl.minimum(z0 + Z_PER, ZN), Z_CHUNK):
            offs_z = s + tl.arange(0, Z_CHUNK)
            tl.store(z_ptr + offs_z, tl.zeros((Z_CHUNK,), tl.int32), mask=offs_z < tl.minimum(z0 + Z_PER, ZN))
    if GROUP:
        qb = tl.zeros((BLOCK_D,), tl.float32)
        for g in range(G):
            qb += tl.load(q_ptr + r * sq_r + (h * G + g) * sq_h + mm * DB + offs_d, mask=dmask,
                          other=0.0).to(tl.float32)
    else:
        qb = tl.load(q_ptr + r * sq_r + h * sq_h + mm * DB + offs_d, mask=dmask, other=0.0).to(tl.float32)
    dots = tl.sum(cent * qb[None, :], axis=1)
    dots = tl.where(offs_c < C, dots, float("-inf"))
    best = tl.argmax(dots, axis=0)
    tl.store(ids_ptr + r * so_r + h * so_h + mm, best.to(tl.int32))
    tl.store(w_ptr + r * so_r + h * so_h + mm, tl.sqrt(tl.sum(qb * qb, axis=0)))


def route(q: torch.Tensor, centroids: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None,
          group: bool = False, zero: torch.Tensor | None = None, pdl: bool = False,
          pre_wait: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher; `out` (ids, qnorm) lets a captured graph reuse static buffers. `zero`, a
    contiguous int32 buffer (the Top-K workspace), is zeroed by the same launch: one launch
    less per step than a separate memset. pre_wait (with pdl): load the centroids before
    waiting for the predecessor (they must not be written by the step, sync.py)."""
    if q.dim() != 3 or centroids.dim() != 5:
        raise ValueError(f"q {tuple(q.shape)} must be [R, Hq, D], centroids {tuple(centroids.shape)} [R, Hkv, m, C, d_b]")
    r, hq, d = q.shape
    hkv, m, c, db = centroids.shape[1:]
    if centroids.shape[0] != r or hq % hkv or m * db != d:
        raise ValueError(f"q {tuple(q.shape)} does not match centroids {tuple(centroids.shape)}")
    if q.stride(2) != 1 or centroids.stride(4) != 1:
        raise ValueError("q and centroids need a contiguous last dimension")
    ho = hkv if group else hq
    ids, w = out if out is not None else (
        torch.empty(r, ho, m, dtype=torch.int32, device=q.device),
        torch.empty(r, ho, m, dtype=torch.float32, device=q.device))
    if not (ids.is_contiguous() and w.is_contiguous() and ids.shape == (r, ho, m) == w.shape):
        raise ValueError(f"outputs must be contiguous [{r}, {ho}, {m}]")
    if zero is not None and (zero.dtype != torch.int32 or not zero.is_contiguous()):
        raise ValueError(f"zero {zero.dtype} must be a contiguous int32 buffer")
    zn = zero.numel() if zero is not None else 0
    sc = centroids.stride()
    _route_kernel[(r * ho, m)](q, centroids, ids, w, ho, hq // hkv, m, c, db,
                               q.stride(0), q.stride(1), sc[0], sc[1], sc[2], sc[3],
                               ids.stride(0), ids.stride(1), zero if zero is not None else ids,
                               max(1, -(-zn // (r * ho * m))), zn,
                               BLOCK_C=triton.next_power_of_2(c), BLOCK_D=max(16, triton.next_power_of_2(db)),
                               GROUP=group, ZERO=zero is not None, Z_CHUNK=1024, USE_PDL=pdl, PRE_WAIT=pre_wait,
                               **launch_opts(pdl))
    return ids, w
