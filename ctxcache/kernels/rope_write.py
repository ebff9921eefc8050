"""One decode token's RoPE and KV-cache write in one launch (the model's per-layer glue); also a
one-row prompt's, its tokens as the rows (llama.Attention.rope_and_write).

For a single new token per row, the torch path (rope.apply_rope twice + KVCache.write) is ~25
small launches per layer (gather the angles, cast, six products, two concatenations, two index
writes, ...); in a CUDA-graph decode step each launch costs more than its work. Here one
program per (row, head) rotates a query head, or rotates a key head and stores it with its value
head at the row's position.

q [B, Hq, D], k/v [B, Hkv, D] (any strides, last dim contiguous), table [S, 2, D/2]
(rope.rope_table; fp32, or the model's dtype once the model is cast), pos [B] int -> rotated
q [B, Hq, D]; k_cache/v_cache [B, Hkv, S_max, D] receive the rotated k and v at pos[b].
Arithmetic in fp32, rounded once to the output dtype (the torch path rounds after each bf16
product). v_start [B] int (optional): v_cache holds each row's positions from v_start[b] on (an
offloaded row's HBM tail after its int8-coded context), so v goes to pos[b] - v_start[b]; a
position outside [0, v_cache's length) is not written (a throw-away token of a row that holds no
stream's position there)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ctxcache.models.rope import apply_rope


def rope_write_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, pos: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, v_start: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference: apply_rope on q and k, KVCache.write of k and v (one token per row)."""
    p = pos.long()[:, None]
    qr = apply_rope(q[:, :, None], table, p)[:, :, 0]
    kr = apply_rope(k[:, :, None], table, p)[:, :, 0]
    rows = torch.arange(q.shape[0], device=q.device)
    k_cache[rows, :, p[:, 0]] = kr.to(k_cache.dtype)
    vp = p[:, 0] if v_start is None else p[:, 0] - v_start.long()
    ok = (vp >= 0) & (vp < v_cache.shape[2])
    v_cache[rows[ok], :, vp[ok]] = v[ok].to(v_cache.dtype)
    return qr


# V_LEN (the cache's length) is not specialized: a cache of each length would otherwise pick its
# own compilation (divisibility by 16), the reference runner's per-request caches while serving
@triton.jit(do_not_specialize=["V_LEN"])
def _rope_write_kernel(q_ptr, k_ptr, v_ptr, t_ptr, pos_ptr, qo_ptr, kc_ptr, vc_ptr, vstart_ptr, HQ, V_LEN,
                       sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, st_s, so_b, so_h,
                       skc_b, skc_h, skc_s, svc_b, svc_h, svc_s, HALF: tl.constexpr, V_START: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)  # query heads first, then KV heads
    offs = tl.arange(0, HALF)
    pos = tl.load(pos_ptr + b).to(tl.int64)
    cos = tl.load(t_ptr + pos * st_s + offs).to(tl.float32)
    sin = tl.load(t_ptr + pos * st_s + HALF + offs).to(tl.float32)
    if h < HQ:
        src = q_ptr + b * sq_b + h * sq_h
        dst = qo_ptr + b * so_b + h * so_h
    else:
        j = h - HQ
        src = k_ptr + b * sk_b + j * sk_h
        dst = kc_ptr + b * skc_b + j * skc_h + pos * skc_s
        vpos = pos
        if V_START:
            vpos = pos - tl.load(vstart_ptr + b).to(tl.int64)
        keep = (vpos >= 0) & (vpos < V_LEN)
        vpos = tl.where(keep, vpos, 0)
        vc = vc_ptr + b * svc_b + j * svc_h + vpos * svc_s
        vrow = v_ptr + b * sv_b + j * sv_h
        tl.store(vc + offs, tl.load(vrow + offs).to(vc_ptr.dtype.element_ty), mask=keep & (offs < HALF))
        tl.store(vc + HALF + offs, tl.load(vrow + HALF + offs).to(vc_ptr.dtype.element_ty), mask=keep & (offs < HALF))
    x1 = tl.load(src + offs).to(tl.float32)
    x2 = tl.load(src + HALF + offs).to(tl.float32)
    tl.store(dst + offs, (x1 * cos - x2 * sin).to(dst.dtype.element_ty))
    tl.store(dst + HALF + offs, (x2 * cos + x1 * sin).to(dst.dtype.element_ty))


def rope_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, pos: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor | None = None,
               v_start: torch.Tensor | None = None) -> torch.Tensor:
    """Launcher (shapes as in the module docstring); returns the rotated queries (into `out`,
    [B, Hq, D] of any strides, where given)."""
    b, hq, d = q.shape
    hkv = k.shape[1]
    if (k.shape != (b, hkv, d) or v.shape != k.shape or k_cache.shape[:2] != (b, hkv) or k_cache.shape[3] != d
            or v_cache.shape[:2] != (b, hkv) or v_cache.shape[3] != d
            or (v_start is None and v_cache.shape != k_cache.shape) or (v_start is not None and v_start.shape != (b,))
            or table.shape[1:] != (2, d // 2) or d % 2 or (d // 2) & (d // 2 - 1)):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, cache {tuple(k_cache.shape)}, "
                         f"table {tuple(table.shape)} disagree (head_dim / 2 must be a power of two)")
    if any(t.stride(-1) != 1 for t in (q, k, v, k_cache, v_cache)) or not table.is_contiguous():
        raise ValueError("q, k, v and the caches need a contiguous last dimension, the table a contiguous layout")
    if pos.shape != (b,):
        raise ValueError(f"pos {tuple(pos.shape)} must be [{b}]")
    if out is None:
        out = torch.empty(b, hq, d, dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"out {tuple(out.shape)} must be q's shape {tuple(q.shape)} with a contiguous last dimension")
    _rope_write_kernel[(b, hq + hkv)](q, k, v, table, pos, out, k_cache, v_cache,
                                      pos if v_start is None else v_start, hq, v_cache.shape[2],
                                      q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                                      table.stride(0), out.stride(0), out.stride(1), *k_cache.stride()[:3],
                                      *v_cache.stride()[:3], HALF=d // 2, V_START=v_start is not None,
                                      num_warps=1)
    return out


def rope_write_prompt(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, pos: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """One row's prompt: q [1, Hq, T, D], k/v [1, Hkv, T, D], pos [T], caches [1, Hkv, S, D] ->
    rotated q [1, Hq, T, D]. Its tokens are the launcher's rows, each writing its own position
    of the one cache row (the cache seen through a stride-0 batch dimension)."""
    t = q.shape[2]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)

    def rows(x: torch.Tensor) -> torch.Tensor:  # [1, H, T, D] -> [T, H, D], a view
        return x[0].transpose(0, 1)

    rope_write(rows(q), rows(k), rows(v), table, pos, k_cache.expand(t, -1, -1, -1), v_cache.expand(t, -1, -1, -1),
               out=rows(out))
    return out
