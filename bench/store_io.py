"""`ctxcache bench store_io`: bytes per chunk kind, compression, encode time, whole-artifact load time.

    ctxcache bench store_io --tokens 4096
    ctxcache bench store_io --artifact art.pt      # a torch.save'd ContextArtifact

Builds a real SmolLM2 + CSAttention artifact from the bundled GPL-3 text (unless given one),
puts it into a fresh LMDB store under each put profile and loads it back several times under a
few load settings. Each load is checked against what was put, like with like: the stored form
(the K/V codec's codes, the tables, the tokens) bit for bit, and the codec's error on the decoded
K/V reported apart. Prints the tables, writes <out>/store_io_<device>.json.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from ctxcache.artifact import ContextArtifact
from ctxcache.store import ArtifactStore, StoreConfig

from ctxcache.bench.common.report import add_out, write_result
from ctxcache.quality.texts import builtin_text, tokens_of


def build(n_tokens: int) -> ContextArtifact:
    from ctxcache.indexer import build_artifact
    from ctxcache.methods import make_method
    from ctxcache.models.loader import load_model

    lm = load_model("smollm2")
    ids = tokens_of(lm.tokenizer, builtin_text("prose"), n_tokens, "prose")
    return build_artifact(lm, ids, make_method("csattention"))


def round_trip(a: ContextArtifact, b: ContextArtifact) -> dict:
    """Loaded `b` against the put `a`, like with like: what the store keeps (the K/V codec's codes
    and scales, the tables, tokens, last logits) bit for bit; and, apart, the codec's own error:
    the largest |decoded - original| of K and of V (0 for the lossless codec)."""
    pairs = [(a.tokens, b.tokens), (a.last_logits, b.last_logits)]
    same_tables, err = True, {"k": 0.0, "v": 0.0}
    for la, lb in zip(a.layers, b.layers, strict=True):
        put, got = la.coded_as(a.kv_codec).parts, lb.coded_as(a.kv_codec).parts
        same_tables &= put.keys() == got.keys() and la.tables.keys() == lb.tables.keys()
        pairs += [(put[n], got[n]) for n in put if n in got] + [(la.tables[n], lb.tables[n]) for n in la.tables
                                                                 if n in lb.tables]
        err["k"] = max(err["k"], (lb.k.float() - la.k.float()).abs().max().item())
        err["v"] = max(err["v"], (lb.v.float() - la.v.float()).abs().max().item())
    exact = same_tables and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in pairs)
    return {"bit_exact": exact, "kv_codec": a.kv_codec, "kv_max_abs_error": err}


PROFILES = {"default": {}, "compact": {"min_gain": 0.1}}  # put-time codec choices
LOADS = {"default": {}, "sha256": {"verify_on_load": "sha256"},
         "no_verify": {"verify_on_load": "none"}, "1_thread": {"threads": 1},
         "no_huge_pages": {"huge_pages": False}}


def measure(art: ContextArtifact, profile: dict, loads: dict, reps: int = 5) -> dict:
    out: dict = {"n_tokens": art.n_tokens, "raw_kv_bytes": art.kv_bytes(),
                 "raw_table_bytes": art.table_bytes()}
    with tempfile.TemporaryDirectory() as d:
        cfg = StoreConfig(map_size_bytes=4 << 30, budget_bytes=4 << 30, **profile)
        with ArtifactStore(d, cfg) as s:
            t = time.perf_counter()
            m = s.put("bench", art)
            out["put_s"] = time.perf_counter() - t
        kinds: dict = defaultdict(lambda: {"raw": 0, "stored": 0, "codecs": set()})
        for c in m.chunks:
            k = kinds[c.name if c.layer is None else c.name.removeprefix("t_")]
            k["raw"] += c.raw_bytes
            k["stored"] += c.stored_bytes
            k["codecs"].add(f"{c.codec}:{c.stored_dtype}")
        out["chunks"] = {n: {**v, "codecs": sorted(v["codecs"]), "ratio": v["raw"] / v["stored"]}
                         for n, v in kinds.items()}
        out["stored_bytes"], out["raw_bytes"] = m.stored_bytes, m.raw_bytes()
        out["stored_over_kv"] = m.stored_bytes / art.kv_bytes()
        out["load"] = {}
        for name, kw in loads.items():
            with ArtifactStore(d, StoreConfig(map_size_bytes=4 << 30, budget_bytes=4 << 30,
                                              track_access=False, **kw)) as s:
                times = []
                for _ in range(reps):
                    t = time.perf_counter()
                    got = s.get("bench")
                    times.append(time.perf_counter() - t)
                    del got
                got = s.get("bench")
                out["load"][name] = {"min_s": min(times), "median_s": sorted(times)[reps // 2],
                                     **round_trip(art, got)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ctxcache bench store_io", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--artifact", type=Path)
    ap.add_argument("--reps", type=int, default=5)
    add_out(ap)
    args = ap.parse_args(argv)
    art = torch.load(args.artifact, weights_only=False) if args.artifact else build(args.tokens)
    results = {}
    for prof_name, profile in PROFILES.items():
        loads = LOADS if prof_name == "default" else {"default": {}}
        results[prof_name] = res = measure(art, profile, loads, args.reps)
        print(f"== put profile {prof_name} {profile}")
        report(res)
    print(f"wrote {write_result('store_io', {'tokens': args.tokens, 'profiles': results}, args.out)}")
    return 0


def report(res: dict) -> None:
    print(f"{res['n_tokens']} tokens: raw KV {res['raw_kv_bytes'] / 1e6:.1f} MB, tables "
          f"{res['raw_table_bytes'] / 1e6:.1f} MB, stored {res['stored_bytes'] / 1e6:.1f} MB "
          f"({res['stored_over_kv']:.2f}x KV), put {res['put_s']:.2f} s")
    print(f"{'chunk':12s} {'raw MB':>9s} {'stored MB':>10s} {'ratio':>6s}  codecs")
    for n, v in res["chunks"].items():
        print(f"{n:12s} {v['raw'] / 1e6:9.2f} {v['stored'] / 1e6:10.2f} {v['ratio']:6.2f}  "
              f"{', '.join(v['codecs'])}")
    for n, v in res["load"].items():
        e = v["kv_max_abs_error"]
        print(f"load {n:14s} min {v['min_s']:.3f} s  median {v['median_s']:.3f} s  bit-exact {v['bit_exact']} "
              f"(stored form)  {v['kv_codec']} K/V error max |d| k {e['k']:.4f} v {e['v']:.4f}")


if __name__ == "__main__":
    raise SystemExit(main())
