"""Timing of GPU kernels: a CUDA graph captured after warm-up, and the median of event-timed
runs with L2 emptied before each (by writes, as triton's do_bench, or by reads). What the GPU
benchmarks time with and the kernel tests capture graphs with."""

from __future__ import annotations

from typing import Callable

import torch


def capture_graph(fn: Callable[[], object], warmup: int = 2) -> torch.cuda.CUDAGraph:
    """Run fn a few times on a side stream (compiles, allocates), then capture it."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


FLUSHES = ("write", "read", "none")
_flush = {"mode": "write"}  # the benches' --flush (bench gpu_cli sets it once per process)


def set_flush(mode: str) -> None:
    """The L2 flush every later time_us uses unless told otherwise (and the result JSON records)."""
    if mode not in FLUSHES:
        raise ValueError(f"flush={mode!r} must be one of {FLUSHES}")
    _flush["mode"] = mode


def flush_mode() -> str:
    return _flush["mode"]


def time_us(fn: Callable[[], object], rep_ms: int = 100, flush: str | None = None) -> float:
    """Median time in microseconds over runs of fn, each after L2 is emptied (events around fn).
    flush None: set_flush's mode (default "write").

    flush="write": triton's do_bench, which empties L2 by zeroing 256 MB, so each run starts
    with L2 full of dirty lines that fn's own misses write back to DRAM. flush="read": the
    same loop, emptying L2 by reading 256 MB instead, so fn starts with L2 full of clean lines,
    as after a model's weight reads. A short memory-bound fn pays for the write-backs of up to
    one L2 (50 MB on the H100) in the first, not in the second. flush="none": L2 left as the
    previous run left it (a check that the read flush does evict)."""
    import triton.testing
    flush = flush or flush_mode()
    if flush not in FLUSHES:
        raise ValueError(f"flush={flush!r} must be one of {FLUSHES}")
    if flush == "write":
        return 1000.0 * triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")
    cache = torch.ones(256 << 20 >> 2, dtype=torch.int32, device="cuda")
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        if flush == "read":
            cache.sum()
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate_ms = start.elapsed_time(end) / 5
    for _ in range(max(1, int(25 / estimate_ms))):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(max(1, int(rep_ms / estimate_ms)))]
    ends = [torch.cuda.Event(enable_timing=True) for _ in starts]
    for s, e in zip(starts, ends):
        if flush == "read":
            cache.sum()  # reads only: L2 is left holding clean lines of the cache
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    return 1000.0 * times[len(times) // 2]
