"""`ctxcache bench tier_load`: a cold load from the shared object store to a usable artifact,
beside a load from the local LMDB, for one real artifact.

    ctxcache bench tier_load --tokens 4096 [--kv-codec int8]
    ctxcache bench tier_load --object-store 's3://bucket/p?endpoint_override=127.0.0.1:8333&scheme=http'

Builds a SmolLM2 + CSAttention artifact from the bundled text (or takes --artifact, a torch.save'd
ContextArtifact), puts it once through a TieredStore, then per repetition: a cold load on a
fresh local LMDB (download, checksums, local copy, decode: what a worker that never saw the
context pays), the object store alone (download + checksums + decode, no local copy), and the
warm local LMDB load. A file:// tier in a temp folder is always measured; --object-store adds
an S3 one. Prints a table, writes <out>/tier_load_<device>.json.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from ctxcache.artifact import ContextArtifact
from ctxcache.store import ArtifactStore, ObjectArtifactStore, StoreConfig, TieredStore

from ctxcache.bench.common.report import add_out, write_result
from ctxcache.bench.store_io import build

CFG = StoreConfig(map_size_bytes=4 << 30, budget_bytes=3 << 30, track_access=False)


def _timed(fn, reps: int) -> dict:  # noqa: ANN001
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        got = fn()
        times.append(time.perf_counter() - t)
        assert got is not None
        del got
    return {"min_s": min(times), "median_s": statistics.median(times), "runs": len(times)}


def measure(art: ContextArtifact, uri: str, reps: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        writer = TieredStore(ArtifactStore(Path(d) / "writer", CFG), ObjectArtifactStore(uri, codec=CFG))
        t = time.perf_counter()
        m = writer.put("bench", art)
        put_s = time.perf_counter() - t
        fresh = [TieredStore(ArtifactStore(Path(d) / f"w{i}", CFG), ObjectArtifactStore(uri, codec=CFG))
                 for i in range(reps)]  # fresh workers, each with its own empty LMDB (opened untimed)
        workers = iter(fresh)
        out = {"uri": uri.split("?")[0], "stored_bytes": m.stored_bytes, "chunks": len(m.chunks), "put_s": put_s,
               "cold_tiered": _timed(lambda: next(workers).get("bench"), reps),
               "object_only": _timed(lambda: writer.shared.get("bench"), reps),
               "local_lmdb": _timed(lambda: writer.local.get("bench"), reps)}
        for w in (writer, *fresh):
            w.close()
    for k in ("cold_tiered", "object_only", "local_lmdb"):
        out[k]["mb_per_s"] = out["stored_bytes"] / out[k]["median_s"] / 1e6
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ctxcache bench tier_load", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--kv-codec", default="int8", choices=("lossless", "int8", "int4"))
    ap.add_argument("--artifact", type=Path, help="a torch.save'd ContextArtifact (else built, see --save)")
    ap.add_argument("--save", type=Path, help="torch.save the built artifact here for the next run")
    ap.add_argument("--object-store", action="append", default=[], help="an s3:// URI to measure too")
    ap.add_argument("--reps", type=int, default=5)
    add_out(ap)
    args = ap.parse_args(argv)
    art = torch.load(args.artifact, weights_only=False) if args.artifact else build(args.tokens)
    if args.save and not args.artifact:
        torch.save(art, args.save)
    art = replace(art, kv_codec=args.kv_codec)
    results = []
    with tempfile.TemporaryDirectory() as folder:
        for uri in [f"file://{folder}/shared", *args.object_store]:
            results.append(measure(art, uri, args.reps))
    print(f"{art.n_tokens} tokens, kv codec {args.kv_codec}, {results[0]['stored_bytes'] / 1e6:.1f} MB stored "
          f"in {results[0]['chunks']} chunks; median of {args.reps}")
    print(f"{'tier':40s} {'put s':>6s} {'cold (new worker) s':>20s} {'object only s':>14s} {'local LMDB s':>13s}")
    for r in results:
        print(f"{r['uri'][:40]:40s} {r['put_s']:6.2f} {r['cold_tiered']['median_s']:20.3f} "
              f"{r['object_only']['median_s']:14.3f} {r['local_lmdb']['median_s']:13.3f}")
    path = write_result("tier_load", {"tokens": art.n_tokens, "kv_codec": args.kv_codec, "tiers": results}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
