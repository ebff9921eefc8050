"""`ctxcache bench object_read`: how fast the object tier reads a load's chunks, beside the wire.

    ctxcache bench object_read --layers 32      # 2.1 GB: a 32K Llama-3.1-8B int8 artifact's chunk sizes

A private SeaweedFS on this machine holds synthetic chunks of a real artifact's sizes (per layer
two 32 MB K/V chunks and two 1 MB table chunks); each repeat reads them all into memory touched
already (as the server's host pool is): through the tier (`get_many_into`, one pool of 8 MB
ranged reads), the same with each chunk's xxh3 checked as it lands (what a load does), and a
plain loop of ranged GETs on keep-alive connections (http.client, GET only, same threads and
ranges: what the wire gives without pyarrow). Medians of --repeats; GB/s and CPU seconds per GB
of this process and of the SeaweedFS server. Writes object_read_<device>.json.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import http.client
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

import numpy as np

from ctxcache.bench.common.fleet_servers import private_s3
from ctxcache.bench.common.report import add_out, write_result

MB = 1 << 20


def plain_gets(endpoint: str, paths: list[str], outs: list[memoryview], range_bytes: int, threads: int) -> None:
    """Every range of every object by a bare ranged GET straight into outs (one connection per thread)."""
    local = threading.local()

    def one(path: str, out: memoryview, off: int) -> None:
        conn = getattr(local, "conn", None) or http.client.HTTPConnection(endpoint, timeout=30)
        local.conn = conn
        end = min(off + range_bytes, len(out))
        conn.request("GET", path, headers={"Range": f"bytes={off}-{end - 1}"})
        resp, got, view = conn.getresponse(), 0, out[off:end]
        while got < end - off and (n := resp.readinto(view[got:])):
            got += n
        resp.read()
        if resp.status != 206 or got != end - off:
            raise OSError(f"GET {path} at {off}: status {resp.status}, {got} of {end - off} bytes")

    with cf.ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda a: one(*a), [(p, o, off) for p, o in zip(paths, outs)
                                          for off in range(0, len(o), range_bytes)]))


def server_cpu(name: str = "weed") -> float:
    """CPU seconds (user + system) of this process's children called `name` (Linux /proc)."""
    total = 0
    for d in Path("/proc").iterdir():
        try:
            stat = (d / "stat").read_text() if d.name.isdigit() else ""
        except OSError:
            continue
        if stat and stat[stat.index("(") + 1:stat.rindex(")")] == name:
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[1]) == os.getpid():
                total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ctxcache bench object_read", description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32, help="layers of chunks (2 x 32 MB + 2 x 1 MB each)")
    ap.add_argument("--repeats", type=int, default=5)
    add_out(ap)
    args = ap.parse_args(argv)

    from ctxcache.store import codec
    from ctxcache.store.tiers import arrow, open_tier

    sizes = [32 * MB, 32 * MB, MB, MB] * args.layers
    total, rng = sum(sizes), np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp, private_s3(Path(tmp) / "s3") as uri:
        tier = open_tier(uri)
        keys = [f"v1/bench/{i:04d}" for i in range(len(sizes))]
        firsts = []
        for key, size in zip(keys, sizes):
            data = rng.integers(0, 255, size, dtype=np.uint8)
            tier.put(key, memoryview(data))
            firsts.append(data[:64].tobytes())
        outs = [memoryview(np.zeros(s, np.uint8)) for s in sizes]  # touched: no page faults in the timing
        u = urlsplit(uri)
        endpoint, paths = dict(parse_qsl(u.query))["endpoint_override"], [f"/{u.netloc}/{u.path.strip('/')}/{k}" for k in keys]
        ways: dict[str, Callable[[], object]] = {
            "tier": lambda: tier.get_many_into(keys, outs, lambda i, n: None),
            "tier_xxh3": lambda: tier.get_many_into(keys, outs, lambda i, n: codec.fast_checksum(outs[i])),
            "plain_get": lambda: plain_gets(endpoint, paths, outs, arrow.RANGE_BYTES, tier.config.read_threads),
        }
        runs: dict[str, list[tuple[float, float, float]]] = {w: [] for w in ways}
        for _ in range(args.repeats):
            for way, fn in ways.items():
                for o in outs:
                    o[:64] = b"\0" * 64
                cpu0, weed0, t0 = time.process_time(), server_cpu(), time.perf_counter()
                fn()
                wall = time.perf_counter() - t0
                runs[way].append((wall, time.process_time() - cpu0, server_cpu() - weed0))
                if [bytes(o[:64]) for o in outs] != firsts:
                    raise AssertionError(f"{way} read other bytes than were stored")
        tier.close()
    rows = {way: {"gb_s": total / statistics.median(r[0] for r in rs) / 1e9,
                  "client_cpu_s_per_gb": statistics.median(r[1] for r in rs) / total * 1e9,
                  "server_cpu_s_per_gb": statistics.median(r[2] for r in rs) / total * 1e9,
                  "runs_gb_s": [round(total / r[0] / 1e9, 3) for r in rs]} for way, rs in runs.items()}
    print(f"{len(sizes)} objects, {total / 1e9:.2f} GB, {args.repeats} repeats (medians)")
    for way, row in rows.items():
        print(f"  {way:10s} {row['gb_s']:5.2f} GB/s   CPU s/GB: this process {row['client_cpu_s_per_gb']:.2f}, "
              f"SeaweedFS {row['server_cpu_s_per_gb']:.2f}   runs {row['runs_gb_s']}")
    path = write_result("object_read", {"objects": len(sizes), "bytes": total, "repeats": args.repeats,
                                        "range_bytes": arrow.RANGE_BYTES, "rows": rows}, args.out)
    print(f"wrote {path}")
    return 0
