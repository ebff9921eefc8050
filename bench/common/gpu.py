"""The GPU benchmarks' shared parts: random inputs of CSAttention's shapes (Llama-3.1-8B attention
shapes), a random-weight model, the common arguments, and timing (CUDA graph capture, median of
events with L2 emptied before each run)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from ctxcache.bench.common.report import add_out
from ctxcache.decoder.gpu.selector import GpuDenseTables, GpuTables
from ctxcache.methods.csattention import CSAttentionParams
from ctxcache.models.config import NAMED_CONFIGS
from ctxcache.models.llama import Transformer

HQ, HKV, D = 32, 8, 128


def random_tables(batch: int, n: int, params: CSAttentionParams, device: str) -> GpuTables:
    """Random tables with CSAttention's shapes and invariants (unit centroids, descending scores)."""
    m, c, l = params.subspaces, params.centroids, params.list_length(n)
    cent = F.normalize(torch.randn(batch, HKV, m, c, D // m, device=device), dim=-1).half()
    idx = torch.randint(0, n, (batch, HKV, m, c, l), dtype=torch.int32, device=device)
    # descending by construction (a sort of 2^31 entries at batch 8 x 128K would need 20 GB)
    ramp = torch.linspace(1.0, -1.0, l, device=device)
    score = (ramp + torch.randn(batch, HKV, m, c, 1, device=device)).half()
    floor = score[..., -1].contiguous()
    return GpuTables(cent, idx, score, floor, torch.zeros(batch, HKV, m, c, 1, device=device),
                     torch.full((batch,), n, dtype=torch.int32, device=device),
                     torch.zeros(batch, dtype=torch.int32, device=device), (floor - 0.5).contiguous())


def random_dense_tables(batch: int, n: int, params: CSAttentionParams, device: str, score_dtype: str = "float16",
                        max_new: int = 1) -> GpuDenseTables:
    """Random dense-layout tables (unit centroids, scores ~ N(0, 1)), generated in place in their
    storage dtype (an fp32 temporary of 17 GB at batch 8 x 128K would not fit)."""
    m, c = params.subspaces, params.centroids
    cent = F.normalize(torch.randn(batch, HKV, m, c, D // m, device=device), dim=-1).half()
    scale = None
    if score_dtype == "int8":
        dense = torch.randint(-127, 128, (batch, HKV, m, c, n), dtype=torch.int8, device=device)
        scale = torch.rand(batch, HKV, m, c, device=device) / 127 + 1e-3
    else:
        dense = torch.empty(batch, HKV, m, c, n, dtype=torch.float16, device=device).normal_()
    nt = torch.full((batch,), n, dtype=torch.int32, device=device)
    return GpuDenseTables(cent, dense, scale, nt, torch.zeros(batch, HKV, m, c, max_new, device=device),
                          nt.clone(), torch.zeros(batch, dtype=torch.int32, device=device))


def batch_dense_tables(batch: int, n: int, params: CSAttentionParams, device: str, score_dtype: str = "float16",
                       max_new: int = 1, shared: bool = False) -> GpuDenseTables:
    """Random dense tables for `batch` rows: each row its own (the default, as a batch of distinct
    contexts), or with `shared` one row's tables seen by every row through stride-0 views. Shared
    rows read the same bytes, so a batch reads them from DRAM once and then from L2: faster than
    any real batch of distinct contexts, and said so in the results (tables_shared_across_batch_rows)."""
    if not shared:
        return random_dense_tables(batch, n, params, device, score_dtype, max_new)
    return rows_view(random_dense_tables(1, n, params, device, score_dtype, max_new), batch, max_new)


def rows_view(t: GpuDenseTables, batch: int, max_new: int) -> GpuDenseTables:
    """t's tables (of 1 or `batch` rows) as `batch` rows (stride 0 where t has one), with streamed
    state of their own (new_scores for max_new keys, n_ctx, stream_start, stream_count)."""
    n = int(t.n_ctx[0])
    dev = t.dense_score.device

    def rows(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x.expand(batch, *x.shape[1:])
    return dataclasses.replace(
        t, centroids=rows(t.centroids), dense_score=rows(t.dense_score), score_scale=rows(t.score_scale),
        n_ctx=torch.full((batch,), n, dtype=torch.int32, device=dev),
        new_scores=torch.zeros(batch, *t.new_scores.shape[1:4], max_new, device=dev),
        stream_start=torch.full((batch,), n, dtype=torch.int32, device=dev),
        stream_count=torch.zeros(batch, dtype=torch.int32, device=dev))


def dense_table_bytes(batch: int, n: int, params: CSAttentionParams, score_dtype: str) -> int:
    """Bytes of the dense score rows of `batch` rows [B, Hkv, m, C, N] (int8: 1 byte, fp16: 2)."""
    return batch * HKV * params.subspaces * params.centroids * n * (1 if score_dtype == "int8" else 2)


def sdpa_dense(q, k, v):
    """Dense SDPA with GQA, flash where it runs; -> (output, backend name)."""
    try:
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True), "flash"
    except RuntimeError:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True), "default"


def random_model(layers: int, max_len: int) -> Transformer:
    """Llama-3.1-8B shapes with `layers` layers, bf16, weights ~ N(0, 0.02) (speed does not depend on them)."""
    args = dataclasses.replace(NAMED_CONFIGS["llama-3.1-8b"], n_layers=layers, max_seq_len=max_len)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Transformer(args).to(torch.bfloat16)
    for p in model.parameters():
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=0.02)
    return model.cuda().eval().requires_grad_(False)  # rope_table is built on the CPU


def gpu_cli(prog: str, contexts: str, argv: list[str] | None,
            extra: Callable[[argparse.ArgumentParser], None] | None = None,
            description: str | None = None, batches: bool = True) -> argparse.Namespace | None:
    """The GPU benches' shared arguments (--contexts, --batches unless `batches` is off, --out,
    plus `extra`'s); None, after saying so, where there is no CUDA GPU."""
    ap = argparse.ArgumentParser(prog=prog, description=description,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default=contexts, type=positive_ints, help="comma-separated context lengths")
    if batches:
        ap.add_argument("--batches", default="1,8", type=positive_ints, help="comma-separated batch sizes")
    ap.add_argument("--seed", default=0, type=int,
                    help="seed of the random inputs (tables, queries, K/V), so runs compare on the same rows")
    add_out(ap)
    ap.add_argument("--flush", default="write", choices=("write", "read"),
                    help="how L2 is emptied before each timed run: zeroing 256 MB (triton do_bench, the default) "
                         "or reading 256 MB (L2 left clean, as after a model's weight reads; time_us)")
    if extra is not None:
        extra(ap)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"{prog}: error: needs a CUDA GPU", file=sys.stderr)
        return None
    set_flush(args.flush)
    torch.manual_seed(args.seed)
    return args


def positive_ints(text: str) -> list[int]:
    """argparse type: "1,8" -> [1, 8], with a one-line error for anything else."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of whole numbers") from None
    if any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be positive")
    return values


def grid_points(args: argparse.Namespace) -> Iterator[tuple[int, int]]:
    """(batch, context) for each of gpu_cli's batches x contexts; the caching allocator is
    emptied after each (batch 8 at 128K holds ~20 GB)."""
    for b in args.batches:
        for n in args.contexts:
            yield b, n
            torch.cuda.empty_cache()


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
_flush = {"mode": "write"}  # the benches' --flush (gpu_cli sets it once per process)


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
