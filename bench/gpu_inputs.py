"""Random inputs of CSAttention's shapes for the GPU benchmarks (Llama-3.1-8B attention shapes)."""

from __future__ import annotations

import argparse
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from ctxcache.decoder.gpu.selector import GpuDenseTables, GpuTables
from ctxcache.decoder.gpu.timing import set_flush
from ctxcache.methods.csattention import CSAttentionParams

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


def gpu_cli(prog: str, contexts: str, argv: list[str] | None,
            extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace | None:
    """The GPU benches' shared arguments (--contexts, --batches, --out, plus `extra`'s); None,
    after saying so, where there is no CUDA GPU."""
    ap = argparse.ArgumentParser(prog=prog)
    ap.add_argument("--contexts", default=contexts, type=positive_ints, help="comma-separated context lengths")
    ap.add_argument("--batches", default="1,8", type=positive_ints, help="comma-separated batch sizes")
    ap.add_argument("--seed", default=0, type=int,
                    help="seed of the random inputs (tables, queries, K/V), so runs compare on the same rows")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--flush", default="write", choices=("write", "read"),
                    help="how L2 is emptied before each timed run: zeroing 256 MB (triton do_bench, the default) "
                         "or reading 256 MB (L2 left clean, as after a model's weight reads; decoder/gpu/timing.py)")
    if extra is not None:
        extra(ap)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"{prog} needs a CUDA GPU")
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

