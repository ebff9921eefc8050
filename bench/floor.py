"""What a per-layer decode step cannot go below on this GPU, measured in the attention bench's
harness (one CUDA graph per variant, median replay, L2 flushed before each replay).

- chain: N dependent launches of a kernel that reads one value the previous launch wrote and
  writes one (132 programs): the fixed cost of a step's launch sequence, with and without
  programmatic dependent launch;
- stream: one launch reading a contiguous buffer (the score kernel's table rows, 16 MB per
  128K-token layer at batch 1);
- gather: one launch reading K and V rows (256 bytes each) at random indices, summing them
  (the sparse attention's bytes: 5% of 128K keys x 8 KV heads).

The step probe (`python -m ctxcache.bench.step_probe`) runs these beside the step's own times."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ctxcache.decoder.gpu.timing import capture, time_us
from ctxcache.kernels.sync import launch_opts, pdl_enter


@triton.jit
def _chain_kernel(src_ptr, dst_ptr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    pid = tl.program_id(0)
    tl.store(dst_ptr + pid, tl.load(src_ptr + pid) + 1)


@triton.jit
def _stream_kernel(x_ptr, out_ptr, N, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros((BLOCK,), tl.float32)
    for s in range(pid * BLOCK, N, tl.num_programs(0) * BLOCK):
        acc += tl.load(x_ptr + s + tl.arange(0, BLOCK), mask=s + tl.arange(0, BLOCK) < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


@triton.jit
def _gather_kernel(k_ptr, v_ptr, idx_ptr, out_ptr, K_SEL, S, D: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)  # (batch, KV head) row of the cache
    blk = tl.program_id(1)
    t = blk * BLOCK + tl.arange(0, BLOCK)
    pos = tl.load(idx_ptr + row * K_SEL + t, mask=t < K_SEL, other=0).to(tl.int64)
    offs_d = tl.arange(0, D)
    base = row.to(tl.int64) * S * D + pos[:, None] * D + offs_d[None, :]
    kv = tl.load(k_ptr + base).to(tl.float32) + tl.load(v_ptr + base).to(tl.float32)
    tl.store(out_ptr + (row * tl.num_programs(1) + blk) * D + offs_d, tl.sum(kv, axis=0))


def chain(n_launches: int, pdl: bool) -> float:
    bufs = [torch.arange(132, dtype=torch.int32, device="cuda") for _ in range(n_launches + 1)]

    def run():
        for i in range(n_launches):
            _chain_kernel[(132,)](bufs[i], bufs[i + 1], USE_PDL=pdl, **launch_opts(pdl))
    return time_us(capture(run).replay)


def stream(n_bytes: int) -> float:
    x = torch.randn(n_bytes // 2, device="cuda", dtype=torch.float16)
    out = torch.empty(132 * 8, device="cuda")
    return time_us(capture(lambda: _stream_kernel[(132 * 8,)](x, out, x.numel(), BLOCK=2048, num_warps=8)).replay)


def gather(rows: int, n: int, k_sel: int, d: int = 128, block: int = 64) -> float:
    k = torch.randn(rows, n, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    idx = torch.stack([torch.randperm(n, device="cuda")[:k_sel] for _ in range(rows)]).int()
    nb = triton.cdiv(k_sel, block)
    out = torch.empty(rows * nb * d, device="cuda")
    return time_us(capture(lambda: _gather_kernel[(rows, nb)](k, v, idx, out, k_sel, n, D=d, BLOCK=block)).replay)


def floor_rows(n: int, batch: int, k_sel: int, table_bytes: int, hkv: int = 8) -> list[dict]:
    """Chain, stream and gather times of one (context, batch); bytes as the step moves them."""
    base = {"context": n, "batch": batch}
    rows = [{**base, "method": f"floor_chain{c}{'_pdl' if p else ''}", "time_us": chain(c, p)}
            for c in (1, 2, 4, 6) for p in (False, True)]
    rows.append({**base, "method": "floor_stream_tables", "time_us": stream(table_bytes), "bytes": table_bytes})
    gb = batch * hkv * k_sel * 2 * 128 * 2
    rows.append({**base, "method": "floor_gather_kv", "time_us": gather(batch * hkv, n, k_sel), "bytes": gb})
    return rows
