"""Where a first token comes from: a context's TTFT from each tier against re-prefilling it.

    ctxcache bench tiers --model random:llama-3.1-8b --device cuda --dtype bfloat16 --contexts 32000,124000

One `ctxcache serve` process with a local LMDB and an object store (a private SeaweedFS where
`weed` is installed, else a folder), read through its gRPC API alone. Per context length: the
PutContext until READY (the median of --put-repeats distinct texts, and from the server's log
each one's build and the store write left after it); then per repeat a 20-token question's TTFT
with the context resident in HBM, in DRAM (admin Evict device_only), in the local store with its file in the page cache (Evict
memory_only), in the local store after the page cache was dropped (root only; skipped otherwise;
the LMDB pages the server keeps mapped stay cached, so this row reads much like the last), and
in the object store alone (Evict local_only: this worker's copies gone), once with the store's
files dropped from the page cache (`object_cold`: SeaweedFS on this machine reads its disk) and
once with them cached (`object`: a store serving a hot object from memory). Beside them, on
this process's own copy of the model before the server starts: the dense prefill of the same
token count in one pass and in the indexer's 4K chunks (the faster is the baseline), and the
card's pinned host -> device copy rate; each tier's effective GB/s is the artifact's stored bytes
over its TTFT. Prints a table, writes tiers_<device>.json.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import torch

from ctxcache.bench.common.fleet_servers import binary, private_s3
from ctxcache.bench.common.reprefill import reprefill_seconds
from ctxcache.bench.common.server_log import build_split
from ctxcache.bench.common.report import add_out, commit, device_tag, machine_info, print_table, write_result
from ctxcache.bench.common.serve_client import generate
from ctxcache.bench.common.serve_limits import h2d_gb_per_s
from ctxcache.client.server_process import running_server
from ctxcache.bench.serve import context_text, put_all
from ctxcache.client import Client
from ctxcache.client.gen.v1 import admin_pb2 as apb, context_pb2 as pb
from ctxcache.models.loader import load_model

GiB = 1 << 30
TIERS = ("hbm", "dram", "local", "local_cold", "object", "object_cold")


def on_the_model(args, contexts: list[int]) -> tuple[dict[int, dict], list[list[str]], float]:
    """Prefill baselines per length, --put-repeats distinct context texts per length, and the
    link's copy rate."""
    lm = load_model(args.model, getattr(torch, args.dtype), args.device)
    rate = h2d_gb_per_s() if args.device == "cuda" else 0.0
    base, texts = {}, []
    for n in contexts:
        runs = args.baseline_repeats or args.repeats
        one = min(reprefill_seconds(lm, n + 20, n + 20) for _ in range(runs))
        chunked = min(reprefill_seconds(lm, n + 20, 4096) for _ in range(runs))
        base[n] = {"prefill_one_pass_s": one, "prefill_4k_chunks_s": chunked, "reprefill_s": min(one, chunked)}
        texts.append([context_text(lm.tokenizer, n, 7000 + n + 100 * j) for j in range(args.put_repeats)])
    del lm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return base, texts, rate


def drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def tier_ttfts(client: Client, cid: str, repeats: int) -> dict[str, list[float]]:
    """TTFT samples per tier; each sample puts the context where its tier says, then asks."""
    evict = client.admin.Evict
    moves: dict[str, Callable[[], bool]] = {
        "object_cold": lambda: evict(apb.EvictRequest(context_id=cid, local_only=True)) is not None and drop_page_cache(),
        "object": lambda: evict(apb.EvictRequest(context_id=cid, local_only=True)) is not None,
        "local_cold": lambda: evict(apb.EvictRequest(context_id=cid, memory_only=True)) is not None and drop_page_cache(),
        "local": lambda: evict(apb.EvictRequest(context_id=cid, memory_only=True)) is not None,
        "hbm": lambda: True,
        "dram": lambda: evict(apb.EvictRequest(context_id=cid, device_only=True)) is not None,
    }
    out: dict[str, list[float]] = {t: [] for t in TIERS}
    for _ in range(repeats):
        # each leaves what the next needs; object_cold's read brings the object store's files back
        # into its page cache, so `object` reads them from memory (as a store serving a hot object)
        for tier in ("object_cold", "object", "local_cold", "local", "hbm", "dram"):
            if moves[tier]():
                out[tier].append(generate(client, cid, 1).timings.ttft_seconds)
    return out


def server_flags(args, data: Path, uri: str, longest: int) -> list[str]:
    return ["--model", args.model, "--device", args.device, "--dtype", args.dtype, "--data", str(data),
            "--object-store", uri, "--store-budget-gb", str(args.store_gb), "--dram-cache-gb", str(args.dram_gb),
            "--gpu-slots", "1", "--gpu-slot-tokens", str(longest + 64 + 256 + 64), "--max-streams", "16",
            "--no-access-log"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ctxcache bench tiers", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--contexts", default="4000", help="context lengths in tokens, comma separated")
    ap.add_argument("--repeats", type=int, default=3, help="TTFT samples per tier (medians reported)")
    ap.add_argument("--baseline-repeats", type=int, default=0, help="prefills per baseline, the fastest kept "
                    "(0: --repeats; at 124K one pass takes ~37 s on an H200)")
    ap.add_argument("--put-repeats", type=int, default=3, help="PutContexts of distinct texts per length "
                    "(median reported; the first is the context the tiers read, the others are deleted)")
    ap.add_argument("--store-gb", type=float, default=40.0)
    ap.add_argument("--dram-gb", type=float, default=12.0, help="the server's DRAM cache (a 124K int8 artifact is 8 GB)")
    ap.add_argument("--merge", action="store_true", help="keep the rows of other context lengths already in "
                    "the output's tiers_<device>.json (each row carries its own commit, date and baselines)")
    ap.add_argument("--log", help="keep the server's log in this file (default: a temporary folder's)")
    add_out(ap)
    args = ap.parse_args(argv)
    if min(args.repeats, args.put_repeats) < 1 or args.baseline_repeats < 0:
        ap.error(f"--repeats {args.repeats} and --put-repeats {args.put_repeats} must be >= 1, "
                 f"--baseline-repeats {args.baseline_repeats} >= 0")
    contexts = [int(x) for x in args.contexts.split(",")]
    base, texts, rate = on_the_model(args, contexts)
    rows = []
    with tempfile.TemporaryDirectory(prefix="ctxcache-bench-tiers-") as tmp, ExitStack() as stack:
        uri = (stack.enter_context(private_s3(Path(tmp) / "s3")) if _has_weed()
               else f"file://{Path(tmp) / 'objects'}")
        log = Path(args.log) if args.log else Path(tmp) / "serve.log"
        address = stack.enter_context(running_server(server_flags(args, Path(tmp) / "data", uri, max(contexts)), log,
                                                     verbose=True))  # its "built" lines: build_split
        client = Client(address)
        for n, text in zip(contexts, texts):
            cids, puts = put_all(client, text[:1])
            parts = client.admin.Describe(apb.DescribeRequest(context_id=cids[0])).stored_bytes_by_part
            stored = sum(b for part, b in parts.items() if part != "queries")  # what a load reads
            ttfts = tier_ttfts(client, cids[0], args.repeats)
            more, more_s = more_puts(client, text[1:])  # after the tiers: they must not share its memory
            puts += more_s
            row = {"context": n, "object_store": uri.split("?")[0].split(":")[0], "stored_bytes": stored,
                   "h2d_gb_per_s": rate, "put_s": statistics.median(puts), "put_runs": puts,
                   **build_split(log, cids + more), "prefill_s": base[n]["prefill_4k_chunks_s"], **base[n]}
            for tier, xs in ttfts.items():
                row[f"ttft_{tier}_s"] = statistics.median(xs) if xs else None
                row[f"ttft_{tier}_runs"] = xs
                if tier != "hbm":  # a resident context moves no bytes
                    row[f"{tier}_gb_per_s"] = stored / statistics.median(xs) / 1e9 if xs else None
                row[f"{tier}_over_reprefill"] = statistics.median(xs) / row["reprefill_s"] if xs else None
            row["put_over_prefill"] = row["put_s"] / row["prefill_s"]
            print(row, flush=True)
            rows.append(row)
            out, table = save(args, rows)  # each length as it ends: a later one's failure keeps it
        client.close()
    print_table(table, ["context", "stored_bytes", *(f"ttft_{t}_s" for t in TIERS), "reprefill_s",
                        "prefill_one_pass_s"])
    print_table(table, ["context", "h2d_gb_per_s", *(f"{t}_gb_per_s" for t in TIERS[1:]),
                       "local_over_reprefill", "object_over_reprefill", "put_s", "put_build_s",
                        "put_write_after_build_s", "prefill_s", "put_over_prefill"])
    print(f"wrote {out}")
    return 0


def save(args, rows: list[dict]) -> tuple[Path, list[dict]]:
    """Write the rows measured so far (stamped; with --merge beside the file's rows of other
    lengths) and return the file and its rows."""
    info = machine_info()
    stamp = {"commit": commit(), "date": datetime.date.today().isoformat()}
    table = [{**r, **stamp} for r in rows]
    if args.merge:
        table = sorted(kept_rows(Path(args.out) / f"tiers_{device_tag(info)}.json", [r["context"] for r in rows])
                       + table, key=lambda r: r["context"])
    out = write_result("tiers", {"device": (info.get("gpu") or {}).get("name") or info["cpu"], "model": args.model,
                                 "dtype": args.dtype, "rows": table}, args.out)
    return out, table


def more_puts(client: Client, texts: list[str]) -> tuple[list[str], list[float]]:
    """PutContext until READY of each text, each context deleted after (the store keeps room)."""
    cids, puts = put_all(client, texts)
    for cid in cids:
        client.context.DeleteContext(pb.DeleteContextRequest(context_id=cid), metadata=client.metadata)
    return cids, puts


def kept_rows(path: Path, contexts: list[int]) -> list[dict]:
    """The rows of an earlier result at `path` for context lengths this run did not measure."""
    if not path.exists():
        return []
    return [r for r in json.loads(path.read_text()).get("rows", []) if r.get("context") not in contexts]


def _has_weed() -> bool:
    try:
        return bool(binary("weed"))
    except FileNotFoundError:
        return False


if __name__ == "__main__":
    raise SystemExit(main())
