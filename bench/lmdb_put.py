"""`ctxcache bench lmdb_put`: a build's put into the local LMDB store, until READY, against the
build's own pace: each layer committed as it is handed over (streaming) vs all at finish
(deferred, the one-transaction put). Issue 44.

    ctxcache bench lmdb_put --dir /data/bench-lmdb       # on the disk the store lives on
    ctxcache bench lmdb_put --tokens 32768 --pace-ms 60 --repeats 3

A synthetic int8 artifact of Llama-3.1-8B shapes (32 layers, 8 KV heads, 128 dims: 2.1 GB at
32K tokens, random codes, so nothing compresses) is handed to `ArtifactStore.writer` one layer
every --pace-ms (a layer-major build's pace: a 32K prefill of 1.81 s on an H200 is ~57 ms a
layer), then `finish`ed. READY is when `finish` returns (the manifest committed); the table
shows it beside the pace's total and what was left after the last layer. A fresh store per
run (fsync at commit unless --no-sync, as the service's). Writes lmdb_put_<device>.json.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ctxcache.artifact import ContextArtifact, LayerArtifact
from ctxcache.kv_codec import CodedKV
from ctxcache.store import ArtifactStore, ContextMeta, StoreConfig
from ctxcache.store.artifact_writer import DeferredWriter

from ctxcache.bench.common.report import add_out, write_result


def synthetic(tokens: int, layers: int, heads: int, dim: int) -> ContextArtifact:
    """Random int8 K/V codes and scales of the codec's shapes (one small layer encoded for them)."""
    shapes = CodedKV.encode(torch.zeros(heads, tokens, dim, dtype=torch.bfloat16),
                            torch.zeros(heads, tokens, dim, dtype=torch.bfloat16), "int8").parts
    g = torch.Generator().manual_seed(0)

    def rand(t: torch.Tensor) -> torch.Tensor:
        if t.dtype == torch.int8:
            return torch.randint(-128, 128, t.shape, dtype=torch.int8, generator=g)
        return torch.rand(t.shape, generator=g).to(t.dtype)

    out = [LayerArtifact(coded=CodedKV("int8", {n: rand(t) for n, t in shapes.items()},
                                       (heads, tokens, dim), torch.bfloat16))
           for _ in range(layers)]
    return ContextArtifact(model_id="synthetic:llama-3.1-8b", model_args={"n_layers": layers},
                           method="dense", method_params={}, tokens=torch.arange(tokens),
                           last_logits=torch.zeros(128256), layers=out, kv_dtype="bfloat16",
                           kv_codec="int8")


def coded_bytes(art: ContextArtifact) -> int:
    return sum(t.numel() * t.element_size() for layer in art.layers for t in layer.coded.parts.values())


def one_put(art: ContextArtifact, root: Path, mode: str, pace_s: float, sync: bool) -> dict:
    size = coded_bytes(art)
    root.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix="lmdb-put-", dir=root))
    try:
        cfg = StoreConfig(map_size_bytes=2 * size + (256 << 20), budget_bytes=2 * size, sync=sync)
        with ArtifactStore(path, cfg) as s:
            w = s.writer("bench") if mode == "streaming" else DeferredWriter(s, "bench", ContextMeta())
            t0 = time.perf_counter()
            for i, layer in enumerate(art.layers):
                time.sleep(max(0.0, t0 + (i + 1) * pace_s - time.perf_counter()))  # the layer's build
                w.add_layer(i, layer, art.kv_codec)
            built = time.perf_counter()
            m = w.finish(art)
            ready = time.perf_counter()
            assert s.verify("bench").ok
        return {"ready_s": ready - t0, "built_s": built - t0, "after_build_s": ready - built,
                "stored_bytes": m.stored_bytes}
    finally:
        shutil.rmtree(path, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ctxcache bench lmdb_put", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--pace-ms", type=float, default=60.0, help="one layer handed over every this many ms")
    ap.add_argument("--modes", default="streaming,deferred")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()),
                    help="where the fresh stores go (the store's disk: fsync speed decides)")
    ap.add_argument("--no-sync", action="store_true", help="StoreConfig(sync=False): no fsync at commit")
    add_out(ap)
    args = ap.parse_args(argv)
    art = synthetic(args.tokens, args.layers, args.kv_heads, args.head_dim)
    pace_s = args.pace_ms / 1000
    total = pace_s * args.layers
    print(f"{args.tokens} tokens, {args.layers} layers x {args.kv_heads} heads x {args.head_dim} int8: "
          f"{coded_bytes(art) / 1e9:.2f} GB coded K/V; a layer every {args.pace_ms:.0f} ms = {total:.2f} s; "
          f"sync={not args.no_sync}, stores under {args.dir}")
    print(f"{'mode':10s} {'READY s':>8s} {'x pace':>7s} {'after build s':>14s}  (median of {args.repeats})")
    results = {}
    for mode in args.modes.split(","):
        runs = [one_put(art, args.dir, mode, pace_s, not args.no_sync) for _ in range(args.repeats)]
        med = {k: statistics.median(r[k] for r in runs) for k in ("ready_s", "after_build_s")}
        results[mode] = {"runs": runs, **med, "ready_over_pace": med["ready_s"] / total}
        print(f"{mode:10s} {med['ready_s']:8.2f} {med['ready_s'] / total:7.2f} {med['after_build_s']:14.2f}")
    payload = {"tokens": args.tokens, "layers": args.layers, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
               "pace_ms": args.pace_ms, "pace_total_s": total, "sync": not args.no_sync, "modes": results}
    print(f"wrote {write_result('lmdb_put', payload, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
