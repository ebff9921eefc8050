"""The GPU benchmarks' shared parts: random inputs of CSAttention's shapes (Llama-3.1-8B attention
shapes), a random-weight model, the common arguments, (timing: ctxcache/kernels/timing.py)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from ctxcache.bench.common.report import add_out
from ctxcache.kernels.timing import set_flush
from ctxcache.decoder.gpu.tables import GpuDenseTables, GpuTables
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
