"""Probe: the attention started on pass 0's definite winners, with radix pass 1 and the collect off the chain.

After the score kernel (16-bit keys + radix pass 0 histogram) the top byte b of the K-th key is
known; every key whose top byte is above b is selected whatever pass 1 finds. A design that
attends to those keys at once, and resolves only the threshold bucket's ties beside them, takes
pass 1 and the collect off the step's chain (`attn_parts_probe`'s bound: 32.4 vs 38.6 us at 128K
batch 1 on the H100, mark 34.7).

This probe times route -> score -> this kernel -> merge. Each program of the kernel owns one
radix block of one (row, KV head): it walks pass 0's histogram to b, compacts its block's
definite winners into its own list slice, and attends the group's queries over them into a
partial. `ties=True` adds the tie branch (radix pass 1, then the threshold bucket's selected
keys, ranked as topk's collect ranks them), forked onto a side stream and joined before the
merge: the exact Top-K attention. Static keys (sinks, recent window: 36 of ~6.6K) are left out.

Measured on the H100 (bench/README.md): 40.0 us against the default step's 38.1 at 128K batch 1
(read flush 37.2 vs 34.1), so it is not in the decoder.

`thresh` (the `known_threshold_*` rows) is a bound for every design in which the attention finds
its own keys after the score kernel: the K-th key's code is given before the replay, so the
kernel compares each key against it (ties all taken) and attends, with no walk and no tie
ranking. A design with coarser keys (a finer pass-0 histogram whose threshold bucket is taken
whole, no pass 1 and no collect launch) would sit at or above it. Measured on the H100: 36.4 us
(write flush; read flush 32.9) against the 6x mark's 34.7 (32.0), so that design was not built.

`python -m ctxcache.bench.pass0_attention_probe [--contexts 131072] [--batches 1] [--flush write|read] [--out DIR]`
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from ctxcache.kernels.sparse_attention import (INTERPRET, empty_partial, group_queries, merge_partials,
                                               online_softmax_step, padded_group, sparse_attention_ref, store_partial)
from ctxcache.kernels.sync import launch_opts
from ctxcache.kernels.topk import (_HEAD, _WALK0, _block_keys16, _bounds_then_wait, _pass1_16_kernel, _rank2d,
                                   _walk, _walk_from, blocks16, key16_codes, topk16_ref)


def key_codes(keys: torch.Tensor) -> torch.Tensor:
    """16-bit keys (uint16, or int32 codes already) as int32 codes on the CPU."""
    return (key16_codes(keys) if keys.dtype == torch.uint16 else keys.int()).cpu()


def kth_key_ref(keys: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Per row of 16-bit keys [R, N] (int32 codes): the k-th largest code in [lo, hi) (65536, which
    no key reaches, where k is 0), int32 [R]."""
    return torch.tensor([int(torch.topk(keys[r, int(lo[r]):int(hi[r])], int(k[r])).values[-1]) if int(k[r]) else 1 << 16
                         for r in range(keys.shape[0])], dtype=torch.int32)


def threshold_winners_ref(keys: torch.Tensor, thresh: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> list[torch.Tensor]:
    """Per row of 16-bit keys [R, N] (int32 codes): the positions in [lo, hi) with a code >= thresh[r]."""
    return [torch.nonzero(keys[r, int(lo[r]):int(hi[r])] >= int(thresh[r])).flatten().cpu() + int(lo[r])
            for r in range(keys.shape[0])]


def definite_winners_ref(keys: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, k: torch.Tensor) -> list[torch.Tensor]:
    """Per row of 16-bit keys [R, N] (int32 codes): the positions in [lo, hi) whose top byte is
    above the top byte of the row's k-th largest key (sorted)."""
    out = []
    for r in range(keys.shape[0]):
        lo_r, hi_r, k_r = int(lo[r]), int(hi[r]), int(k[r])
        region = keys[r, lo_r:hi_r]
        if k_r == 0:
            out.append(torch.zeros(0, dtype=torch.long))
            continue
        top = int(torch.topk(region, k_r).values[-1]) >> 8
        out.append(torch.nonzero((region >> 8) > top).flatten().cpu() + lo_r)
    return out


@triton.jit
def _attend_list(q_ptr, k_ptr, v_ptr, r, lst, n_take, o_ws, ml_ws, slot, HKV: tl.constexpr, G, scale_log2,
                 sq_b, sq_h, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s,
                 G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """Attend row r's group of queries over the n_take positions at lst; partial into `slot`."""
    b = r // HKV
    hkv = r % HKV
    offs_d = tl.arange(0, D)
    q = group_queries(q_ptr, b, hkv, G, sq_b, sq_h, G_PAD, D)
    k_row = k_ptr + b.to(tl.int64) * sk_b + hkv * sk_h
    v_row = v_ptr + b.to(tl.int64) * sv_b + hkv * sv_h
    m_i, l_i, acc = empty_partial(G_PAD, D)
    for c0 in range(0, n_take, BLOCK_N):
        c = c0 + tl.arange(0, BLOCK_N)
        valid = c < n_take
        pos = tl.load(lst + c, mask=valid, other=0)
        kb = tl.load(k_row + pos[:, None].to(tl.int64) * sk_s + offs_d[None, :])
        vb = tl.load(v_row + pos[:, None].to(tl.int64) * sv_s + offs_d[None, :])
        m_i, l_i, acc = online_softmax_step(q, kb, vb, valid, m_i, l_i, acc, scale_log2, IEEE)
    store_partial(o_ws, ml_ws, slot, m_i, l_i, acc, G, G_PAD, D)


@triton.jit
def _compact(take, offs, lst):
    """Store the taken offsets at lst in index order; their count (visible to every thread after)."""
    rank, n_take = _rank2d(take.to(tl.int32))
    tl.store(lst + rank, offs, mask=take)
    tl.debug_barrier()  # every thread's compacted positions are visible to all threads below
    return n_take


@triton.jit
def _pass0_attend_kernel(q_ptr, k_ptr, v_ptr, keys_ptr, lo_ptr, hi_ptr, ksel_ptr, ws_ptr, list_ptr, o_ws, ml_ws,
                         HKV: tl.constexpr, G, scale_log2, sq_b, sq_h, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sx_r, sws_r,
                         thr_ptr, BLOCK: tl.constexpr, NB: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                         BLOCK_N: tl.constexpr, IEEE: tl.constexpr, USE_PDL: tl.constexpr, KNOWN: tl.constexpr):
    """Definite winners: keys whose top byte is above the K-th key's (pass 0's walk). KNOWN: every
    key at or above the row's threshold code at thr_ptr instead (no walk; the bound of a step
    whose attention finds its own keys after the score kernel)."""
    r, lo, hi, k = _bounds_then_wait(lo_ptr, hi_ptr, ksel_ptr, HKV, USE_PDL, True)
    blk = tl.program_id(1)
    key1, offs, hist_ptr = _block_keys16(keys_ptr, r, lo, hi, k, ws_ptr, sx_r, sws_r, BLOCK)
    if KNOWN:
        take = key1 > tl.load(thr_ptr + r).to(tl.uint32)  # key1 = key + 1 inside [lo, hi), else 0
    else:
        prefix, _ = _walk(hist_ptr, k, 1, 8)  # the K-th key's top byte, in prefix >> 8
        take = (key1 > 0) & (((key1 - 1) >> 8) > (prefix >> 8))
    slot = r * 2 * NB + blk
    n_take = _compact(take, offs, list_ptr + slot.to(tl.int64) * BLOCK)
    _attend_list(q_ptr, k_ptr, v_ptr, r, list_ptr + slot.to(tl.int64) * BLOCK, n_take, o_ws, ml_ws, slot, HKV, G,
                 scale_log2, sq_b, sq_h, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, G_PAD, D, BLOCK_N, IEEE)


@triton.jit
def _ties_attend_kernel(q_ptr, k_ptr, v_ptr, keys_ptr, lo_ptr, hi_ptr, ksel_ptr, ws_ptr, list_ptr, o_ws, ml_ws,
                        HKV: tl.constexpr, G, scale_log2, sq_b, sq_h, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sx_r, sws_r,
                        HEAD, BLOCK: tl.constexpr, NB: tl.constexpr, NB_PAD: tl.constexpr, G_PAD: tl.constexpr,
                        D: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """After radix pass 1: the selected keys of the K-th key's top-byte bucket (above the exact
    threshold, and its ties to the lowest index), as topk's collect ranks them."""
    r, lo, hi, k = _bounds_then_wait(lo_ptr, hi_ptr, ksel_ptr, HKV, False, True)
    blk = tl.program_id(1)
    key1, offs, hist_ptr = _block_keys16(keys_ptr, r, lo, hi, k, ws_ptr, sx_r, sws_r, BLOCK)
    thresh, need = _walk_from(hist_ptr, tl.load(hist_ptr + _WALK0).to(tl.uint32), tl.load(hist_ptr + _WALK0 + 1),
                              1, 2, 8)
    bucket = (key1 > 0) & (((key1 - 1) >> 8) == (thresh >> 8))
    eq = key1 == thresh + 1
    rank_eq, _ = _rank2d(eq.to(tl.int32))
    bs = tl.arange(0, NB_PAD)  # ties in the blocks before this one, from their pass-1 histograms
    eq_before = tl.sum(tl.load(hist_ptr + HEAD + bs * 256 + (thresh & 255).to(tl.int32), mask=bs < blk, other=0),
                       axis=0)
    take = (bucket & (key1 > thresh + 1)) | (eq & (eq_before + rank_eq < need))
    slot = r * 2 * NB + NB + blk
    n_take = _compact(take, offs, list_ptr + slot.to(tl.int64) * BLOCK)
    _attend_list(q_ptr, k_ptr, v_ptr, r, list_ptr + slot.to(tl.int64) * BLOCK, n_take, o_ws, ml_ws, slot, HKV, G,
                 scale_log2, sq_b, sq_h, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, G_PAD, D, BLOCK_N, IEEE)


def pass0_buffers(rows: int, nb: int, block: int, g_pad: int, d: int, device) -> tuple[torch.Tensor, ...]:
    """(position lists, partial outputs, partial (max, sum)) for 2 x nb slots per row: the
    definite winners' blocks, then the ties' blocks. Partials start empty (max -inf, sum 0,
    output 0), so a slot no kernel writes merges as nothing."""
    slots = rows * 2 * nb * g_pad
    ml = torch.zeros(slots, 2, dtype=torch.float32, device=device)
    ml[:, 0] = float("-inf")
    return (torch.zeros(rows * 2 * nb * block, dtype=torch.int32, device=device),
            torch.zeros(slots * d, dtype=torch.float32, device=device), ml.view(-1))


def pass0_attention(q, k_cache, v_cache, keys, lo, hi, k, ws, block: int, bufs=None, out=None,
                    pdl: bool = False, block_n: int = 64, num_warps: int = 4, ties: bool = False,
                    side: torch.cuda.Stream | None = None, thresh: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of q [B, Hq, D] over each row's definite winners (definite_winners_ref) of
    keys [B, Hkv, N_pad] uint16 whose pass-0 histogram is in ws, in radix blocks of `block`.
    ties: also radix pass 1 and the attention over the threshold bucket's selected keys, on the
    `side` stream where given (a fork joined before the merge), so the result is the attention
    over the exact Top-K (topk16_ref); ws then needs a block histogram per block (topk.workspace).
    thresh: int32 [B * Hkv] key codes; attend over every key >= its row's code instead
    (threshold_winners_ref; a bound, not a selection: nothing computes the threshold)."""
    if thresh is not None and ties:
        raise ValueError("thresh replaces the walk; it takes no tie branch")
    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    nb = blocks16(keys.shape[2], block)
    if nb & (nb - 1):
        raise ValueError(f"{nb} blocks per row: the merge needs a power of two")
    g = hq // hkv
    g_pad = padded_group(g)
    rows = b * hkv
    bufs = pass0_buffers(rows, nb, block, g_pad, d, q.device) if bufs is None else bufs
    lst, o_ws, ml_ws = bufs
    out = torch.empty_like(q) if out is None else out
    common = (q, k_cache, v_cache, keys, lo, hi, k, ws, lst, o_ws, ml_ws, hkv, g, d ** -0.5 * 1.4426950408889634,
              q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], keys.stride(1), ws.stride(0))
    shape = dict(G_PAD=g_pad, D=d, BLOCK_N=block_n, IEEE=q.dtype == torch.float32 or INTERPRET, num_warps=num_warps)
    if ties:
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            _pass1_16_kernel[(rows, nb)](keys, lo, hi, k, ws, hkv, keys.stride(1), ws.stride(0), _HEAD, BLOCK=block,
                                         num_warps=4, USE_PDL=False)
            _ties_attend_kernel[(rows, nb)](*common, _HEAD, BLOCK=block, NB=nb, NB_PAD=nb, **shape)
    _pass0_attend_kernel[(rows, nb)](*common, lo if thresh is None else thresh, BLOCK=block, NB=nb, USE_PDL=pdl,
                                     KNOWN=thresh is not None, **shape, **launch_opts(pdl))
    if ties and side is not None:
        torch.cuda.current_stream().wait_stream(side)
    return merge_partials((o_ws, ml_ws), out, hkv, 2 * nb, pdl and not ties)


def pass0_attention_ref(q, k_cache, v_cache, keys, lo, hi, k, ties: bool = False,
                        thresh: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference (fp32, CPU): per (row, KV head) sparse_attention_ref over its definite
    winners (definite_winners_ref), with ties over its exact Top-K (topk16_ref), or with thresh
    over the keys at or above it (threshold_winners_ref); no static keys. q [B, Hq, D] -> [B, Hq, D]."""
    b, hkv, n_pad = keys.shape
    g = q.shape[1] // hkv
    rep = [t.cpu().repeat_interleave(hkv) for t in (lo, hi, k)]
    codes = key_codes(keys).reshape(b * hkv, n_pad)
    if thresh is not None:
        win = threshold_winners_ref(codes, thresh.cpu(), rep[0], rep[1])
    else:
        win = topk16_ref(codes, *rep) if ties else definite_winners_ref(codes, *rep)
    out = torch.empty(q.shape, dtype=torch.float32)
    for r, w in enumerate(win):
        bb, h = divmod(r, hkv)
        w = w.cpu().sort().values
        out[bb, h * g:(h + 1) * g] = sparse_attention_ref(
            q[bb:bb + 1, h * g:(h + 1) * g].float().cpu(), k_cache[bb:bb + 1, h:h + 1].float().cpu(),
            v_cache[bb:bb + 1, h:h + 1].float().cpu(), w.int().view(1, 1, -1), torch.tensor([w.numel()]),
            torch.tensor([k_cache.shape[2]]), 0, 0)[0]
    return out


def main(argv: list[str] | None = None) -> int:
    from ctxcache.bench.attention import attend
    from ctxcache.bench.fused_tune import cases
    from ctxcache.bench.gpu_inputs import gpu_cli
    from ctxcache.bench.step_probe import timed
    from ctxcache.decoder.gpu.timing import device_info, print_table, write_results
    from ctxcache.methods import Budget

    args = gpu_cli("pass0_attention_probe", "131072", argv)
    if args is None:
        return 2
    rows = []
    for c in cases(args, Budget(), "int8"):
        base, sel, idx = c.default_selection()
        blk = sel.topk_block
        sel.route_dense(c.q, c.tables, c.lo, c.hi, c.kk)
        got = pass0_attention(c.q, c.k, c.v, sel.keys, c.lo, c.hi, c.kk, sel.ws, blk, pdl=sel.pdl)
        err = float((got.float().cpu() - pass0_attention_ref(c.q, c.k, c.v, sel.keys, c.lo, c.hi, c.kk)).abs().max())
        sel.route_dense(c.q, c.tables, c.lo, c.hi, c.kk)
        got = pass0_attention(c.q, c.k, c.v, sel.keys, c.lo, c.hi, c.kk, sel.ws, blk, pdl=sel.pdl, ties=True)
        err_ties = float((got.float().cpu() - pass0_attention_ref(c.q, c.k, c.v, sel.keys, c.lo, c.hi, c.kk, True))
                         .abs().max())
        rep = [t.cpu().repeat_interleave(c.k.shape[1]) for t in (c.lo, c.hi, c.kk)]
        winners = sum(w.numel() for w in definite_winners_ref(key_codes(sel.keys).flatten(0, 1), *rep)) / len(rep[0])
        side = torch.cuda.Stream()

        def bound():
            sel.route_dense(c.q, c.tables, c.lo, c.hi, c.kk)
            attend(c.q, c.k, c.v, c.nt, idx, c.kk, c.budget, c.splits, sel.pdl)

        rows += [{**base, "method": "step_default", "time_us": timed(lambda: c.step(sel, False))},
                 {**base, "method": "bound_score_then_attention", "time_us": timed(bound)}]
        # the bound of any step whose attention finds its own keys after the score: the K-th key's
        # code given before the replay, so nothing walks a histogram or resolves ties
        thr = kth_key_ref(key_codes(sel.keys).flatten(0, 1), *rep).cuda()
        got = pass0_attention(c.q, c.k, c.v, sel.keys, c.lo, c.hi, c.kk, sel.ws, blk, pdl=sel.pdl, thresh=thr)
        err_thr = float((got.float().cpu() - pass0_attention_ref(c.q, c.k, c.v, sel.keys, c.lo, c.hi, c.kk, thresh=thr))
                        .abs().max())
        taken = sum(w.numel() for w in threshold_winners_ref(key_codes(sel.keys).flatten(0, 1), thr.cpu(), *rep[:2]))
        winners_row = {"max_abs_err_vs_ref": err, "definite_winners_per_row": winners}
        ties_row = {"max_abs_err_vs_ref": err_ties, "definite_winners_per_row": winners}
        known_row = {"max_abs_err_vs_ref": err_thr, "keys_per_row": taken / len(rep[0])}
        # (name, block, warps, probe options, row fields); ties need sel.ws's block histograms, so
        # the selector's block
        for name, block, warps, opts, extra in (
                ("pass0_winners_only", blk, 4, {}, winners_row), ("pass0_winners_only", 2048, 4, {}, winners_row),
                ("pass0_winners_only", blk, 8, {}, winners_row),
                ("pass0_with_ties_forked", blk, 4, {"ties": True, "side": side}, ties_row),
                ("pass0_with_ties_serial", blk, 4, {"ties": True}, ties_row),
                ("pass0_with_ties_forked", blk, 8, {"ties": True, "side": side}, ties_row),
                ("known_threshold", blk, 4, {"thresh": thr}, known_row),
                ("known_threshold", blk, 8, {"thresh": thr}, known_row),
                ("known_threshold", 2 * blk, 8, {"thresh": thr}, known_row),
                ("known_threshold", blk // 2, 4, {"thresh": thr}, known_row)):
            nb = blocks16(sel.keys.shape[2], block)
            bufs = pass0_buffers(c.batch * c.k.shape[1], nb, block, padded_group(c.q.shape[1] // c.k.shape[1]),
                                 c.q.shape[2], "cuda")
            out = torch.empty_like(c.q)

            def p0_step():
                sel.route_dense(c.q, c.tables, c.lo, c.hi, c.kk)
                pass0_attention(c.q, c.k, c.v, sel.keys, c.lo, c.hi, c.kk, sel.ws, block, bufs, out, sel.pdl,
                                num_warps=warps, **opts)
            rows.append({**base, "method": f"{name}_b{block}_w{warps}", "time_us": timed(p0_step), **extra})
        print_table(rows[-12:], ["context", "batch", "method", "time_us"])
        print(f"known threshold: {taken / len(rep[0]):.0f} keys per row, max |err| vs reference {err_thr:.2e}")
        print(f"definite winners per row {winners:.0f} of top_k {c.top_k}; max |err| vs reference: winners only "
              f"{err:.2e}, with ties {err_ties:.2e}")
    path = write_results("pass0_attention_probe", rows, None, args.out)
    print(f"device {device_info()['name']}; wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
