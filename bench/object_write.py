"""`ctxcache bench object_write`: how fast a put's chunks go up to the object store.

    ctxcache bench object_write --layers 32 --io-threads 8,32     # 2.1 GB: a 32K int8 artifact's K/V

A private SeaweedFS on this machine; per repeat, per pyarrow IO thread count, every chunk (two
32 MB K/V chunks per layer, the sizes of a 32K Llama-3.1-8B int8 artifact) is PUT through the
S3 tier on --threads threads, as a put's writer does (ObjectStoreConfig.put_threads). Why the
IO threads: pyarrow uploads an S3 object's parts on its IO pool (8 threads unless set), whatever
the number of threads writing, while a load's ranged reads run on the caller's threads (a 32K
PutContext uploaded at 0.7-0.93 GB/s on the H200 host where reads reached 4.7). Medians of
--repeats. Writes object_write_<device>.json.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import pyarrow as pa

from ctxcache.bench.common.fleet_servers import private_s3
from ctxcache.bench.common.report import add_out, write_result
from ctxcache.store.tiers import open_tier

MB = 1 << 20


def upload_s(tier, keys: list[str], data: memoryview, threads: int) -> float:  # noqa: ANN001 (ObjectTier)
    with cf.ThreadPoolExecutor(threads) as pool:
        t0 = time.perf_counter()
        list(pool.map(lambda key: tier.put(key, data), keys))
        return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ctxcache bench object_write", description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--chunk-mb", type=int, default=32, help="bytes of each K/V chunk (two per layer)")
    ap.add_argument("--threads", type=int, default=16, help="uploads in flight (ObjectStoreConfig.put_threads)")
    ap.add_argument("--io-threads", default="8,32", help="pyarrow IO thread counts to compare, comma separated")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--object-store", help="an s3:// URI to write to instead of a private SeaweedFS")
    add_out(ap)
    args = ap.parse_args(argv)
    data = memoryview(os.urandom(args.chunk_mb * MB))
    n_chunks = 2 * args.layers
    runs: dict[int, list[float]] = {int(x): [] for x in args.io_threads.split(",")}
    with tempfile.TemporaryDirectory(prefix="ctxcache-bench-object-write-") as tmp, ExitStack() as stack:
        uri = args.object_store or stack.enter_context(private_s3(Path(tmp) / "s3"))
        tier = open_tier(uri)
        stack.callback(tier.close)
        tier.put("warm", b"x")
        for rep in range(args.repeats):
            for io, gbs in runs.items():
                pa.set_io_thread_count(io)
                keys = [f"bench-write/{rep}/{io}/{i}" for i in range(n_chunks)]
                seconds = upload_s(tier, keys, data, args.threads)
                gbs.append(n_chunks * len(data) / seconds / 1e9)
                print(f"io threads {io}: {n_chunks} x {args.chunk_mb} MB in {seconds:.2f} s = {gbs[-1]:.2f} GB/s",
                      flush=True)
                tier.delete_prefix(f"bench-write/{rep}/{io}")
    rows = [{"io_threads": io, "threads": args.threads, "chunk_mb": args.chunk_mb, "chunks": n_chunks,
             "gb_per_s": statistics.median(g), "runs_gb_per_s": g} for io, g in runs.items()]
    for r in rows:
        print(f"io threads {r['io_threads']:>3}: {r['gb_per_s']:.2f} GB/s (median of {args.repeats})")
    print(f"wrote {write_result('object_write', {'object_store': 'given' if args.object_store else 'seaweedfs', 'rows': rows}, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
