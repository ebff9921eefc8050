"""The benchmarks a user runs, one command each: `ctxcache bench NAME [--help]`.

Each prints a table and writes `<NAME>_<device>.json` (machine, commit and date inside) to a
scratch folder, or with `--out bench/results` over the committed results. Helpers shared by
several live in bench/common/. Importing this package loads no torch."""

from __future__ import annotations

import importlib
import sys

# name -> (where it runs, what it measures); one module bench/<name>.py with main(argv) each
BENCHMARKS = {
    "fidelity": ("CPU", "sparse decode vs full attention on the real model: recall, top-1 agreement, NLL, passkey"),
    "compare": ("CPU", "every sparse method side by side: fidelity, RULER-style tasks, selection cost (+ plots)"),
    "decode_modes": ("CPU", "the reference decode step sparse vs dense per context length: what --decode-mode auto picks"),
    "service": ("CPU", "the service through gRPC: TTFT cached/cold/re-prefill, artifact size, tokens/s"),
    "footprint": ("CPU", "CSAttention's resident index: mass recall vs index bytes over C, m, row bits (+ plot)"),
    "storage": ("CPU", "per K/V codec through the store: bytes vs fp16 K/V, cold TTFT, mass recall, NLL, passkey"),
    "store_io": ("CPU", "the LMDB store: bytes per chunk kind, compression, put and load times"),
    "lmdb_put": ("any", "a build's put into LMDB until READY, layers handed over at the build's pace: streamed vs one txn"),
    "check": ("GPU", "correctness of the GPU path vs the torch reference (selection overlap, greedy tokens)"),
    "attention": ("GPU", "per-layer decode attention: dense SDPA vs CSAttention selection + sparse attention"),
    "prefill": ("GPU", "per-layer question prefill on a resident context: SDPA vs packed attention, follow seed, index insert"),
    "decode": ("GPU", "whole-model decode tokens/s dense vs CSAttention; index build time; TTFT"),
    "shapes": ("GPU", "the selection kernels at each launch shape on this GPU vs the decoder's: time, same output, best"),
    "step_profile": ("GPU", "the fast runner's decode step by kernel (torch.profiler), sparse and dense, beside its wall time; --admit: an offloaded hot admission, serial vs pipelined host copy"),
    "offload": ("GPU", "decode attention over KV in pinned host memory vs dense on GPU and host"),
    "host_gather": ("GPU", "kernels' zero-copy reads of scattered host rows by page-locking (4 KB, THP, cudaHostAlloc) and row layout"),
    "serve": ("any", "the product path: a real server + gRPC client, sparse vs dense mode, TTFT tiers, tok/s"),
    "http": ("CPU", "the OpenAI-compatible HTTP front vs gRPC on one server: TTFT and tok/s, by reference and automatic"),
    "tiers": ("any", "a context's TTFT from HBM, DRAM, the local store (page cache, dropped), the object store vs re-prefill"),
    "object_read": ("any", "the object tier's read of a load's chunks (SeaweedFS here) beside bare ranged GETs: GB/s, CPU/GB"),
    "object_write": ("any", "a put's chunk uploads through the S3 tier (SeaweedFS here) by pyarrow IO thread count: GB/s"),
    "fleet": ("any", "indexer + decoders on Redis and S3: cold load from the object store vs re-prefill; tok/s of 1 vs N decoders"),
}


def usage() -> str:
    width = max(map(len, BENCHMARKS))
    lines = ["usage: ctxcache bench NAME [--help | ARGS...]", "", "benchmarks:"]
    lines += [f"  {name:<{width}}  {where:<3}  {what}" for name, (where, what) in BENCHMARKS.items()]
    lines += ["", "Each prints a table and writes NAME_DEVICE.json to a scratch folder (--out DIR elsewhere; "
              "--out bench/results updates the committed results); bench/README.md has the recipes."]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """`ctxcache bench ARGV...`: the list of benchmarks, or one benchmark's main(rest)."""
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in BENCHMARKS:
        print(f"ctxcache bench: unknown benchmark {name!r}; one of {', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    return int(importlib.import_module(f"{__name__}.{name}").main(rest) or 0)
