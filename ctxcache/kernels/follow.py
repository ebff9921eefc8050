"""CSAttention's `follow` on the GPU: the keys right after a row's previous best re-ranked keys
are proposed ahead of the estimate's (methods.csattention_refs.promote_successors is the reference).

The selector has written each row's 16-bit keys and added radix pass 0 of [lo, hi) to its
workspace; this launch, before radix pass 1, raises each successor inside [lo, hi) to 0xFFFF,
above every real key (the largest fp16 code, +inf, is 0xFC00), and moves it in the pass-0
histogram from its old bin to the top one. One program per (row, KV head); previous keys are
distinct (a Top-K's), so their successors are too and no key is moved twice; -1 marks none."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ctxcache.kernels.sync import launch_opts, pdl_enter
from ctxcache.kernels.topk import key16_codes

TOP_KEY = 0xFFFF
_TOP: tl.constexpr = tl.constexpr(TOP_KEY)  # what a jitted kernel may read of a global


@triton.jit
def successors(prev_ptr, lo, hi, F, FP: tl.constexpr):
    """A row's previous best keys at prev_ptr (F of them, -1: none) -> their successors [FP] and
    which of those lie inside [lo, hi)."""
    j = tl.arange(0, FP)
    prev = tl.load(prev_ptr + j, mask=j < F, other=-1)
    succ = prev + 1
    return succ, (prev >= 0) & (succ >= lo) & (succ < hi)


@triton.jit
def _promote_kernel(key_ptr, ws_ptr, prev_ptr, lo_ptr, hi_ptr, k_ptr, HKV, F, sk_r, sws_r, sp_r,
                    FP: tl.constexpr, USE_PDL: tl.constexpr):
    r = tl.program_id(0)
    b = r // HKV
    k = tl.load(k_ptr + b)
    succ, inside = successors(prev_ptr + r * sp_r, tl.load(lo_ptr + b), tl.load(hi_ptr + b), F, FP)
    inside = inside & (k > 0)
    pdl_enter(USE_PDL)  # the bounds and the last step's best keys came before; the keys need the wait
    old = tl.load(key_ptr + r.to(tl.int64) * sk_r + succ, mask=inside, other=0).to(tl.int32)
    tl.store(key_ptr + r.to(tl.int64) * sk_r + succ, tl.full([FP], _TOP, tl.uint16), mask=inside)
    hist = ws_ptr + r * sws_r
    tl.atomic_add(hist + (old >> 8), -1, mask=inside, sem="relaxed")
    tl.atomic_add(hist + 255, tl.sum(inside.to(tl.int32), axis=0), sem="relaxed")


def promote_successors(keys: torch.Tensor, ws: torch.Tensor, prev: torch.Tensor, lo: torch.Tensor,
                       hi: torch.Tensor, k: torch.Tensor, pdl: bool = False) -> None:
    """keys [B, Hkv, N] uint16 (radix pass 0 of [lo, hi) in ws, topk.workspace), prev [B, Hkv, F]
    int32 (-1: none), lo, hi, k [B] int32: promote the successors in place (graph-safe). pdl: a
    programmatic dependent launch (sync.py)."""
    b, hkv, _ = keys.shape
    if keys.dtype != torch.uint16 or keys.stride(2) != 1 or keys.stride(0) != hkv * keys.stride(1):
        raise ValueError(f"keys {tuple(keys.shape)} {keys.dtype} must be uint16 [B, Hkv, N], rows mergeable")
    if prev.shape[:2] != (b, hkv) or prev.dtype != torch.int32 or not prev.is_contiguous():
        raise ValueError(f"prev {tuple(prev.shape)} {prev.dtype} must be contiguous int32 [{b}, {hkv}, F]")
    f = prev.shape[2]
    _promote_kernel[(b * hkv,)](keys, ws, prev, lo, hi, k, hkv, f, keys.stride(1), ws.stride(0), prev.stride(1),
                                FP=max(16, triton.next_power_of_2(f)), USE_PDL=pdl, num_warps=4, **launch_opts(pdl))


def promote_ref(keys: torch.Tensor, prev: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                k: torch.Tensor) -> torch.Tensor:
    """Torch reference: int32 codes [B, Hkv, N] of keys with the successors raised to TOP_KEY."""
    codes = key16_codes(keys).clone()
    succ = prev.long() + 1
    inside = ((prev >= 0) & (succ >= lo[:, None, None]) & (succ < hi[:, None, None])
              & (k[:, None, None] > 0))
    hit = torch.zeros_like(codes).scatter_reduce(2, succ.clamp(max=codes.shape[2] - 1), inside.int(), "amax")
    return torch.where(hit.bool(), TOP_KEY, codes)


@triton.jit
def _follow_out_kernel(cand_ptr, slot_ptr, kf_ptr, out_ptr, HKV, F, sc_r, ss_r, so_r, FP: tl.constexpr):
    r = tl.program_id(0)
    kf = tl.load(kf_ptr + r // HKV)
    j = tl.arange(0, FP)
    take = j < kf
    slot = tl.load(slot_ptr + r * ss_r + j, mask=take, other=0)
    pos = tl.load(cand_ptr + r.to(tl.int64) * sc_r + slot, mask=take, other=-1)
    tl.store(out_ptr + r * so_r + j, pos, mask=j < F)


def write_follow(cand: torch.Tensor, slots: torch.Tensor, kf: torch.Tensor, out: torch.Tensor) -> None:
    """out[b, h, j] = cand[b, h, slots[b, h, j]] for j < kf[b], else -1 (one launch for what a
    gather, a where and a copy took three): cand [B, Hkv, KC], slots and out [B, Hkv, F] int32."""
    b, hkv, f = out.shape
    for name, t in (("cand", cand), ("slots", slots), ("out", out)):
        if t.dtype != torch.int32 or t.stride(2) != 1 or t.stride(0) != hkv * t.stride(1):
            raise ValueError(f"{name} {tuple(t.shape)} {t.dtype} must be int32 [B, Hkv, *], rows mergeable")
    _follow_out_kernel[(b * hkv,)](cand, slots, kf, out, hkv, f, cand.stride(1), slots.stride(1), out.stride(1),
                                   FP=max(16, triton.next_power_of_2(f)), num_warps=4)
