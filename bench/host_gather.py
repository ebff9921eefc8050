"""`ctxcache bench host_gather`: how fast kernels read scattered rows of page-locked host memory
(zero-copy over PCIe), by how the memory was page-locked and how the rows are laid out, beside
the bulk host -> device copy.

    ctxcache bench host_gather [--gb 0.25,1,4] [--rows 1048576] [--iters 1,12] [--kinds register,torch_pinned,vmm_host]

Why: the offload attention's misses crossed at ~21 GB/s of a 55 GB/s link, and more programs did
not help (DESIGN.md, "The offload kernel is slow for its bytes"). Suspects, each a row here:
- the count of reads: each miss read its 128-B codes and, elsewhere, its 2-B scale (`scale`);
- the footprint: how much host memory the rows are scattered over (`--gb`, several);
- the pages: the host slots are mmap'd 4 KB pages page-locked by cudaHostRegister (`register`,
  ctxcache.page_lock), so reads scattered over GBs may miss the GPU's TLB at every page, against
  torch's pinned allocator (`torch_pinned`, cudaHostAlloc) and mmap'd pages advised
  MADV_HUGEPAGE before the register (`register_thp`; the AnonHugePages the kernel gave is printed),
  and the driver's own host allocation (`vmm_host`: cuMemCreate on the host NUMA node, mapped
  in its 2 MiB-class granules; bench/common/host_vmm.py);
- the chain: `iters` blocks of rows a program reads one after another (the offload kernel's
  programs walk ~12 blocks), against one block a program.
Each row: --rows rows at uniform random positions over --gb of memory, `block` rows a program,
median time (CUDA events); the gathered rows' sums are checked against torch's on the host.
Writes host_gather_<device>.json."""

from __future__ import annotations

import argparse
import sys
import mmap
import re
from pathlib import Path

import torch
import triton
import triton.language as tl

from ctxcache.bench.common.host_vmm import host_numa_tensor
from ctxcache.bench.common.report import add_out, print_table, write_result
from ctxcache.bench.common.serve_limits import h2d_gb_per_s
from ctxcache.kernels.timing import time_us
from ctxcache.page_lock import page_lock


@triton.jit
def _gather_kernel(src_ptr, scale_ptr, idx_ptr, out_ptr, n_rows, WORDS: tl.constexpr, BLOCK: tl.constexpr,
                   ITERS: tl.constexpr, SCALE: tl.constexpr):
    w = tl.arange(0, WORDS)
    for i in range(ITERS):  # a program's blocks in series, as an offload program's
        offs = (tl.program_id(0) * ITERS + i) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n_rows
        pos = tl.load(idx_ptr + offs, mask=ok, other=0)
        rows = tl.load(src_ptr + pos[:, None] * WORDS + w[None, :], mask=ok[:, None], other=0)
        acc = tl.sum(rows, axis=1)
        if SCALE:  # a 2-B value a row, in another array (as int8 V's scales were)
            acc += tl.load(scale_ptr + pos, mask=ok, other=0).to(tl.int32)
        tl.store(out_ptr + offs, acc, mask=ok)


def allocate(kind: str, content: torch.Tensor) -> torch.Tensor:
    """Page-locked host memory made as `kind` says, holding content (uint8; every page touched);
    vmm_host's is addressed through the device's mapping (a CUDA tensor of host memory)."""
    if kind == "torch_pinned":
        return content.pin_memory()
    if kind == "vmm_host":  # the driver's own host allocation, mapped for the device (host_vmm.py)
        t, granularity = host_numa_tensor(content.numel())
        print(f"vmm_host: {t.numel() / 2**30:.2f} GiB in {granularity >> 10} KiB granules", flush=True)
        return t[:content.numel()].copy_(content)
    buf = mmap.mmap(-1, content.numel(), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if kind == "register_thp":
        buf.madvise(mmap.MADV_HUGEPAGE)  # before the register faults the pages in
    t = torch.frombuffer(page_lock(buf), dtype=torch.uint8, count=content.numel())
    return t.copy_(content)


def anon_huge_gb() -> float:
    """AnonHugePages of this machine (/proc/meminfo), GB."""
    m = re.search(r"AnonHugePages:\s+(\d+) kB", Path("/proc/meminfo").read_text())
    return int(m.group(1)) / 1e6 if m else 0.0


def gather_row(src: torch.Tensor, scales: torch.Tensor, row_bytes: int, scale: bool, iters: int, block: int,
               n_rows: int) -> dict:
    """Time one layout's gather of n_rows random rows from src; check its sums."""
    words = src.view(torch.int32)
    idx = torch.randint(0, src.numel() // row_bytes, (n_rows,), device="cuda", dtype=torch.int64)
    out = torch.empty(n_rows, dtype=torch.int32, device="cuda")
    grid = (triton.cdiv(n_rows, block * iters),)

    def run() -> None:
        _gather_kernel[grid](words, scales, idx, out, n_rows, WORDS=row_bytes // 4, BLOCK=block, ITERS=iters,
                             SCALE=scale)
    run()
    torch.cuda.synchronize()
    check = idx[:4096].cpu()
    on = words.device  # host memory, or (vmm_host) the device's mapping of it
    want = (words.view(-1, row_bytes // 4)[check.to(on)].long().sum(1)
            + (scales[check.to(on)].long() if scale else 0)).cpu()
    if not torch.equal((out[:4096].cpu().long() - want) % (1 << 32), torch.zeros_like(want)):
        raise AssertionError(f"gather of {row_bytes}-B rows read other bytes than the host holds")
    us = time_us(run, flush="none")
    moved = n_rows * (row_bytes + (2 if scale else 0))
    return {"row_bytes": row_bytes, "scale": scale, "iters": iters, "block": block, "us": us,
            "gb_per_s": moved / us / 1e3, "m_rows_per_s": n_rows / us}


def footprint_rows(gb: float, kinds: list[str], iters: list[int], block: int, n_rows: int) -> list[dict]:
    """Every layout's gather over `gb` GiB, each page-locking kind."""
    nbytes = int(gb * (1 << 30)) // 256 * 256
    # every 8 bytes their own index: a row read from the wrong place sums differently
    content = torch.arange(nbytes // 8, dtype=torch.int64).view(torch.uint8)
    scale_content = torch.arange(nbytes // 128, dtype=torch.int16).view(torch.uint8)
    rows = []
    for kind in kinds:
        huge0 = anon_huge_gb()
        try:
            src = allocate(kind, content)
            scales = allocate(kind, scale_content).view(torch.int16)
        except (RuntimeError, OSError, MemoryError) as e:  # a kind this machine cannot allocate: its row says why
            rows.append({"gb": gb, "kind": kind, "error": str(e).splitlines()[0][:200]})
            print(rows[-1], flush=True)
            continue
        huge = anon_huge_gb() - huge0
        for row_bytes, scale in ((128, False), (128, True), (256, False)):
            for it in iters:
                rows.append({"gb": gb, "kind": kind, "anon_huge_gb": round(huge, 2),
                             **gather_row(src, scales, row_bytes, scale, it, block, n_rows)})
                print(rows[-1], flush=True)
        del src, scales
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ctxcache bench host_gather", description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", default="0.25,1,4", help="host memory the rows are scattered over, GiB, comma separated")
    ap.add_argument("--rows", type=int, default=1 << 20, help="rows a launch reads")
    ap.add_argument("--block", type=int, default=64, help="rows a program reads at once")
    ap.add_argument("--iters", default="1", help="blocks a program reads in series, comma separated")
    ap.add_argument("--kinds", default="register,torch_pinned,vmm_host",
                    help="register, register_thp, torch_pinned, vmm_host (cuMemCreate on the host NUMA node)")
    add_out(ap)
    args = ap.parse_args(argv)
    try:
        gbs = [float(x) for x in args.gb.split(",") if x]
        iters = [int(x) for x in args.iters.split(",") if x]
        if not gbs or min(gbs) <= 0 or not iters or min(iters) < 1:
            raise ValueError
    except ValueError:
        print(f"ctxcache bench host_gather: error: --gb {args.gb!r} and --iters {args.iters!r} must be "
              "comma-separated positive numbers", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("ctxcache bench host_gather: error: needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = [r for gb in gbs for r in footprint_rows(gb, args.kinds.split(","), iters, args.block, args.rows)]
    h2d = h2d_gb_per_s()
    path = write_result("host_gather", {"gb": gbs, "rows": args.rows, "h2d_gb_per_s": h2d, "results": rows},
                        args.out)
    print_table(rows, ["gb", "kind", "anon_huge_gb", "row_bytes", "scale", "iters", "us", "gb_per_s",
                       "m_rows_per_s", "error"])
    print(f"bulk host -> device copy: {h2d:.1f} GB/s\nwrote {path}")
    return 0
