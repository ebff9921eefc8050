"""Does the KV cache's layout move the sparse attention's gather? One process, the attention
bench's harness (one CUDA graph per variant, median replay, L2 flushed).

The split-K sparse attention reads 5% of the keys at scattered positions: one 256-byte K row
and one 256-byte V row per selected key and KV head (bf16, head_dim 128). With K and V in
separate [B, Hkv, N, D] caches those are two scattered reads; with the cache interleaved as
[B, Hkv, N, 2, D] (K and V of a token adjacent) they are one 512-byte read. The kernel takes
strides, so the interleaved cache is passed as two strided views; no kernel changes.

Rows: the sparse attention (the decoder's config, over the default selector's own selection)
on both layouts, the floor gather on both layouts, and a plain stream of the table bytes by
torch (sum) beside bench/floor.py's stream kernel, to check that floor.

`python -m ctxcache.bench.kv_layout_probe [--contexts 131072] [--batches 1,8] [--out DIR]`"""

from __future__ import annotations

import torch

from ctxcache.bench.attention import attend, attn_splits
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


def main(argv: list[str] | None = None) -> int:
    args = gpu_cli("ctxcache bench kv_layout_probe", "131072", argv)
    if args is None:
        return 2
    rows, budget = [], Budget()
    for c in cases(args, budget):
        base = {"context": c.n, "batch": c.batch, "top_k": c.top_k}
        sel = c.selector(None, None)
        idx = sel.select(c.q, c.tables, c.lo, c.hi, c.kk).clone()
        splits = attn_splits(c.batch, c.top_k, c.budget)
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
        print_table(rows[-12:], ["context", "batch", "method", "time_us"])
    path = write_results("kv_layout_gather", rows, None, args.out)
    print(f"device {device_info()['name']}; wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
