"""Two Top-Ks of the same 16-bit keys in one pass-1 launch and one collect launch, each chosen
key written as the value it maps to.

Why: the re-rank ranked its candidates twice (the K it keeps, and follow's best few) with two
radix chains over the same keys, then mapped the chosen candidate slots to key positions in
two more launches (a gather and a copy, or write_follow). On the H200 at 32K x 8 that was nine
launches after the score kernel, about 20 us a layer of a 160 us sparse layer, most of it
latency (bench attention, `issues` 46). Here both selections share pass 0 (the producer's,
in the first workspace), read each block of keys once per launch, and the collect stores
map[index] straight into each output; the second output's unused tail gets -1 (follow's
"none"). Ties go to the lowest indices, as radix_topk's 16-bit path (topk16_ref)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ctxcache.kernels.sync import launch_opts
from ctxcache.kernels.topk import (_BINS, _HEAD, _block_keys16, _bounds_then_wait, _collect16, _hist_kernel, _pass1_16,
                                   blocks16)


@triton.jit
def _pass1_pair_kernel(x_ptr, lo_ptr, hi_ptr, ka_ptr, kb_ptr, wsa_ptr, wsb_ptr, HKV: tl.constexpr, sx_r, sws_r,
                       HEAD, BLOCK: tl.constexpr, PAIR: tl.constexpr, USE_PDL: tl.constexpr):
    r, lo, hi, ka = _bounds_then_wait(lo_ptr, hi_ptr, ka_ptr, HKV, USE_PDL, True)
    key1, offs, hist_a = _block_keys16(x_ptr, r, lo, hi, ka, wsa_ptr, sx_r, sws_r, BLOCK)
    _pass1_16(key1, hist_a, hist_a, ka, HEAD)
    if PAIR:  # pass 0 is the first workspace's; pass 1 of the second selection into its own
        _pass1_16(key1, hist_a, wsb_ptr + r * sws_r, tl.load(kb_ptr + r // HKV), HEAD)


@triton.jit
def _collect_pair_kernel(x_ptr, lo_ptr, hi_ptr, ka_ptr, kb_ptr, wsa_ptr, wsb_ptr, map_ptr, outa_ptr, outb_ptr,
                         HKV: tl.constexpr, sx_r, sws_r, sm_r, soa_r, sob_r, FB, HEAD, BLOCK: tl.constexpr,
                         NB_PAD: tl.constexpr, FB_PAD: tl.constexpr, PAIR: tl.constexpr, USE_PDL: tl.constexpr):
    r, lo, hi, ka = _bounds_then_wait(lo_ptr, hi_ptr, ka_ptr, HKV, USE_PDL, True)
    key1, offs, hist_a = _block_keys16(x_ptr, r, lo, hi, ka, wsa_ptr, sx_r, sws_r, BLOCK)
    vals = tl.load(map_ptr + r.to(tl.int64) * sm_r + offs, mask=key1 > 0, other=-1)
    _collect16(key1, offs, hist_a, ka, vals, outa_ptr + r * soa_r, HEAD, BLOCK, NB_PAD)
    if PAIR:
        kb = tl.load(kb_ptr + r // HKV)
        _collect16(key1, offs, wsb_ptr + r * sws_r, kb, vals, outb_ptr + r * sob_r, HEAD, BLOCK, NB_PAD)
        if tl.program_id(1) == 0:  # the entries past kb say "none" (no program writes them)
            j = tl.arange(0, FB_PAD)
            tl.store(outb_ptr + r * sob_r + j, tl.full([FB_PAD], -1, tl.int32), mask=(j >= kb) & (j < FB))


def _check(name: str, t: torch.Tensor, b: int, hkv: int) -> None:
    if t.dtype != torch.int32 or t.shape[:2] != (b, hkv) or t.stride(2) != 1 or t.stride(0) != hkv * t.stride(1):
        raise ValueError(f"{name} {tuple(t.shape)} {t.dtype} must be int32 [{b}, {hkv}, *], rows mergeable")


def radix_topk_pair(keys: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, k: torch.Tensor, out: torch.Tensor,
                    ws: torch.Tensor, mapping: torch.Tensor, k2: torch.Tensor | None = None,
                    out2: torch.Tensor | None = None, ws2: torch.Tensor | None = None, block: int = 4096,
                    hist0_done: bool = True, num_warps: int = 4, pdl: bool = False) -> None:
    """keys [B, Hkv, N] uint16 (topk.keys16_ref codes); lo, hi, k [B] int32 (k <= hi - lo);
    mapping [B, Hkv, >= hi] int32. Row (b, h) gets mapping[b, h, i] of its k[b] largest keys'
    indices i in [lo, hi) in out[b, h, :k[b]] (any order; the rest of out is left as is); with
    k2 (<= k), out2 [B, Hkv, F] gets those of its k2[b] largest, then -1 up to F. ws / ws2
    (topk.workspace with blocks16(N, block) blocks): hist0_done, ws holds pass 0 of [lo, hi)
    and both are otherwise zero; else both are zeroed and pass 0 is taken here. pdl: both launches
    programmatic dependent ones (sync.py; lo, hi and k are read before the wait)."""
    if keys.dim() != 3 or keys.dtype != torch.uint16 or keys.stride(2) != 1:
        raise ValueError(f"keys {tuple(keys.shape)} {keys.dtype} must be uint16 [B, Hkv, N] contiguous in N")
    b, hkv, n = keys.shape
    if keys.stride(0) != hkv * keys.stride(1):
        raise ValueError("keys must have their (B, Hkv) dims mergeable into rows")
    pair = k2 is not None
    if pair and (out2 is None or ws2 is None):
        raise ValueError("a second selection (k2) needs out2 and ws2")
    for name, t in (("lo", lo), ("hi", hi), ("k", k)) + ((("k2", k2),) if pair else ()):
        if t.shape != (b,) or t.dtype != torch.int32:
            raise ValueError(f"{name} {tuple(t.shape)} {t.dtype} must be int32 [{b}]")
    for name, t in (("out", out), ("mapping", mapping)) + ((("out2", out2),) if pair else ()):
        _check(name, t, b, hkv)
    nb = blocks16(n, block)
    for name, w in (("ws", ws),) + ((("ws2", ws2),) if pair else ()):
        if w.shape[0] != b * hkv or w.shape[1] < _HEAD + nb * _BINS or w.stride(1) != 1 or w.stride(0) != ws.stride(0):
            raise ValueError(f"{name} {tuple(w.shape)} needs {b * hkv} rows of {_HEAD + nb * _BINS} columns "
                             f"(and ws's row stride)")
    if not hist0_done:
        ws.zero_()
        if pair:
            ws2.zero_()
        _hist_kernel[(b * hkv, nb)](keys, lo, hi, k, ws, hkv, keys.stride(1), ws.stride(0), P=0, BLOCK=block,
                                    KEY16=True, TOP=8, num_warps=num_warps)
    wb, ob, kb = (ws2, out2, k2) if pair else (ws, out, k)  # unused where not PAIR
    grid = (b * hkv, nb)
    _pass1_pair_kernel[grid](keys, lo, hi, k, kb, ws, wb, hkv, keys.stride(1), ws.stride(0), _HEAD, BLOCK=block,
                             PAIR=pair, USE_PDL=pdl, num_warps=num_warps, **launch_opts(pdl))
    f = ob.shape[2]
    _collect_pair_kernel[grid](keys, lo, hi, k, kb, ws, wb, mapping, out, ob, hkv, keys.stride(1), ws.stride(0),
                               mapping.stride(1), out.stride(1), ob.stride(1), f, _HEAD, BLOCK=block,
                               NB_PAD=triton.next_power_of_2(nb), FB_PAD=max(16, triton.next_power_of_2(f)),
                               PAIR=pair, USE_PDL=pdl, num_warps=num_warps, **launch_opts(pdl))
