"""Does the KV cache's layout move the sparse attention's gather? One process, the attention
bench's harness (one CUDA graph per variant, median replay, L2 flushed).

The split-K sparse attention reads 5% of the keys at scattered positions: one 256-byte K row
and one 256-byte V row per selected key and KV head (bf16, head_dim 128). With K and V in
separate [B, Hkv, N, D] caches those are two scattered reads; with the cache interleaved as
[B, Hkv, N, 2, D] (K and V of a token adjacent) they are one 512-byte read. The kernel takes
strides, so the interleaved cache is passed as two strided views; no kernel changes.

Rows: the sparse attention (the decoder's config, over the default selector's own selection)
on both layouts, the floor gather on both layouts, and a plain stream of the table bytes by
torch (sum) beside bench/floor.py's stream kernel, to check that floor. Then the footprint:
the attention and the gather over caches that hold only the selected keys (the same bytes, in
random order, from a 5% footprint), and the attention with its K/V left in L2 (footprint_rows).

`python -m ctxcache.bench.kv_layout_probe [--contexts 131072] [--batches 1,8] [--out DIR]`"""

from __future__ import annotations

import torch

from ctxcache.bench.attention import attend
from ctxcache.bench.floor import _gather_kernel, stream
from ctxcache.bench.fused_tune import cases
from ctxcache.bench.gpu_inputs import gpu_cli
from ctxcache.decoder.gpu.timing import capture, device_info, print_table, time_us, write_results
from ctxcache.methods import Budget


def interleaved(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same K and V as views of one [B, Hkv, N, 2, D] buffer."""
    kv = torch.stack([k, v], dim=3)
    return kv[:, :, :, 0], kv[:, :, :, 1]


def gather_us(k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor, block: int = 64) -> float:
    """floor.gather over given caches ([rows, N, D] views) and indices [rows, k_sel]."""
    rows, k_sel = idx.shape
    nb = -(-k_sel // block)
    out = torch.empty(rows * nb * k.shape[-1], device="cuda")
    assert k.stride(1) == v.stride(1) and k.stride(0) == v.stride(0)
    # the floor kernel assumes row stride S * D and key stride D: pass element offsets instead
    s_row, s_key = k.stride(0), k.stride(1)
    if s_key == k.shape[-1]:
        def run():
            _gather_kernel[(rows, nb)](k, v, idx, out, k_sel, s_row // s_key, D=k.shape[-1], BLOCK=block)
    else:  # interleaved: key stride 2D; scale the indices instead of changing the kernel
        idx2 = (idx * 2).contiguous()

        def run():
            _gather_kernel[(rows, nb)](k, v, idx2, out, k_sel, s_row // k.shape[-1], D=k.shape[-1], BLOCK=block)
    return time_us(capture(run).replay)


def warm_us(fn, reps: int = 200) -> float:
    """Median time of a graph replay right after another (no L2 flush: what fits in L2 stays)."""
    g = capture(fn)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        g.replay()
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(1000.0 * start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def footprint_rows(c, idx: torch.Tensor, splits: int, pdl: bool, base: dict) -> list[dict]:
    """The same bytes from a smaller footprint: the attention and the floor gather over caches
    holding only the selected keys (+ sinks and recent window), read in random order, against
    the full cache; and the attention with its K/V left in L2 by the replay before."""
    b, hkv, d = c.batch, c.k.shape[1], c.k.shape[-1]
    sinks, recent = c.budget.sinks, c.budget.recent
    n_small = c.top_k + sinks + recent
    ks = torch.randn(b, hkv, n_small, d, device="cuda", dtype=c.k.dtype)
    vs = torch.randn_like(ks)
    nt = torch.full((b,), n_small, dtype=torch.int32, device="cuda")
    perm = torch.stack([torch.randperm(c.top_k, device="cuda") for _ in range(b * hkv)]).int() + sinks
    idx_small = perm.view(b, hkv, c.top_k).contiguous()
    kk = torch.full((b,), c.top_k, dtype=torch.int32, device="cuda")
    rows = [{**base, "method": "attn_full_cache", "footprint_bytes": c.k.numel() * 4, "time_us":
             time_us(capture(lambda: attend(c.q, c.k, c.v, c.nt, idx, c.kk, c.budget, splits, pdl)).replay)},
            {**base, "method": "attn_compact_cache", "footprint_bytes": ks.numel() * 4, "time_us":
             time_us(capture(lambda: attend(c.q, ks, vs, nt, idx_small, kk, c.budget, splits, pdl)).replay)},
            {**base, "method": "attn_full_cache_l2_warm", "note": "no L2 flush; replay after replay",
             "time_us": warm_us(lambda: attend(c.q, c.k, c.v, c.nt, idx, c.kk, c.budget, splits, pdl))}]
    rnd = perm.view(b * hkv, c.top_k).contiguous()
    rows.append({**base, "method": "gather_compact_random", "footprint_bytes": ks.numel() * 4,
                 "time_us": gather_us(ks.flatten(0, 1), vs.flatten(0, 1), rnd)})
    return rows


def main(argv: list[str] | None = None) -> int:
    args = gpu_cli("ctxcache bench kv_layout_probe", "131072", argv)
    if args is None:
        return 2
    rows, budget = [], Budget()
    for c in cases(args, budget):
        base, sel, idx = c.default_selection()
        splits = c.splits
        ki, vi = interleaved(c.k, c.v)
        ref = attend(c.q, c.k, c.v, c.nt, idx, c.kk, c.budget, splits, sel.pdl).clone()
        got = attend(c.q, ki, vi, c.nt, idx, c.kk, c.budget, splits, sel.pdl)
        same = bool(torch.equal(ref, got))
        for name, (k, v) in (("separate", (c.k, c.v)), ("interleaved", (ki, vi))):
            t = time_us(capture(lambda: attend(c.q, k, v, c.nt, idx, c.kk, c.budget, splits, sel.pdl)).replay)
            rows.append({**base, "method": f"attn_{name}", "time_us": t, "same_output": same})
        flat_idx = idx[..., :c.top_k].reshape(-1, c.top_k).contiguous()
        rnd = torch.stack([torch.randperm(c.n, device="cuda")[:c.top_k] for _ in range(flat_idx.shape[0])]).int()
        srt = rnd.sort(-1).values.contiguous()
        for name, (k, v) in (("separate", (c.k, c.v)), ("interleaved", (ki, vi))):
            kf, vf = k.flatten(0, 1), v.flatten(0, 1)
            for iname, ii in (("selection", flat_idx), ("random", rnd), ("sorted", srt)):
                rows.append({**base, "method": f"gather_{name}_{iname}", "time_us": gather_us(kf, vf, ii)})
        nbytes = c.batch * 8 * 8 * c.n * 2
        x = torch.empty(nbytes // 2, device="cuda", dtype=torch.float16).normal_()
        rows.append({**base, "method": "stream_torch_sum", "bytes": nbytes,
                     "time_us": time_us(capture(lambda: x.sum(dtype=torch.float32)).replay)})
        rows.append({**base, "method": "stream_floor_kernel", "bytes": nbytes, "time_us": stream(nbytes)})
        rows += footprint_rows(c, idx, splits, sel.pdl, base)
        print_table(rows[-16:], ["context", "batch", "method", "time_us"])
    path = write_results("kv_layout_footprint", rows, None, args.out)
    print(f"device {device_info()['name']}; wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
