"""`ctxcache bench object_write`: how fast a put's chunks go up to the object store.

    ctxcache bench object_write --layers 32 --io-threads 8,32     # 2.1 GB: a 32K int8 artifact's K/V

A private SeaweedFS on this machine; per repeat, per pyarrow IO thread count, every chunk (two
32 MB K/V chunks per layer, the sizes of a 32K Llama-3.1-8B int8 artifact) is PUT through the
S3 tier on --threads threads, as a put's writer does (ObjectStoreConfig.put_threads). Why the
IO threads: pyarrow uploads an S3 object's parts on its IO pool (8 threads unless set), whatever
the number of threads writing, while a load's ranged reads run on the caller's threads (a 32K
PutContext uploaded at 0.7-0.93 GB/s on the H200 host where reads reached 4.7). Beside each
rate: the CPU seconds per GB this process and the SeaweedFS server spent (from /proc: which side
is busy), and the same chunks written as files into the server's folder (`file`: what the disk
and page cache take, the bound of a store on this machine). Medians of --repeats. Writes
object_write_<device>.json.
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
from ctxcache.bench.object_read import server_cpu
from ctxcache.store.tiers import open_tier

MB = 1 << 20


def file_write_s(folder: Path, n: int, data: memoryview, threads: int) -> float:
    """n files of data written (and closed, not fsynced: SeaweedFS does not fsync) on threads."""
    folder.mkdir(parents=True, exist_ok=True)
    with cf.ThreadPoolExecutor(threads) as pool:
        t0 = time.perf_counter()
        list(pool.map(lambda i: (folder / str(i)).write_bytes(data), range(n)))
        seconds = time.perf_counter() - t0
    for f in folder.iterdir():
        f.unlink()
    return seconds


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
    cpu: dict[int, list[tuple[float, float]]] = {io: [] for io in runs}  # (client, server) s per GB
    files: list[float] = []
    with tempfile.TemporaryDirectory(prefix="ctxcache-bench-object-write-") as tmp, ExitStack() as stack:
        uri = args.object_store or stack.enter_context(private_s3(Path(tmp) / "s3"))
        tier = open_tier(uri)
        stack.callback(tier.close)
        tier.put("warm", b"x")
        for rep in range(args.repeats):
            for io, gbs in runs.items():
                pa.set_io_thread_count(io)
                keys = [f"bench-write/{rep}/{io}/{i}" for i in range(n_chunks)]
                gb = n_chunks * len(data) / 1e9
                c0, s0 = time.process_time(), server_cpu()
                seconds = upload_s(tier, keys, data, args.threads)
                c1, s1 = time.process_time(), server_cpu()
                gbs.append(gb / seconds)
                cpu[io].append(((c1 - c0) / gb, (s1 - s0) / gb))
                print(f"io threads {io}: {n_chunks} x {args.chunk_mb} MB in {seconds:.2f} s = {gbs[-1]:.2f} GB/s; "
                      f"CPU s per GB: client {cpu[io][-1][0]:.2f}, server {cpu[io][-1][1]:.2f}", flush=True)
                tier.delete_prefix(f"bench-write/{rep}/{io}")
            files.append(n_chunks * len(data) / file_write_s(Path(tmp) / "files", n_chunks, data, args.threads) / 1e9)
            print(f"files: {files[-1]:.2f} GB/s", flush=True)
    rows = [{"io_threads": io, "threads": args.threads, "chunk_mb": args.chunk_mb, "chunks": n_chunks,
             "gb_per_s": statistics.median(g), "runs_gb_per_s": g,
             "client_cpu_s_per_gb": statistics.median(c for c, _ in cpu[io]),
             "server_cpu_s_per_gb": statistics.median(v for _, v in cpu[io])} for io, g in runs.items()]
    rows.append({"io_threads": None, "threads": args.threads, "chunk_mb": args.chunk_mb, "chunks": n_chunks,
                 "gb_per_s": statistics.median(files), "runs_gb_per_s": files, "target": "files"})
    for r in rows:
        print(f"io threads {r['io_threads'] or 'files'}: {r['gb_per_s']:.2f} GB/s (median of {args.repeats})")
    print(f"wrote {write_result('object_write', {'object_store': 'given' if args.object_store else 'seaweedfs', 'rows': rows}, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
