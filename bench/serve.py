"""The product path under load: a real `ctxcache` server and a real gRPC client in one run.

For each decode mode (csattention, then the same engine with every layer dense) and context
length: PutContext of as many distinct contexts as streams need, TTFT of a 20-token question
with the context hot in HBM, warm in DRAM and cold in LMDB, the TTFT of re-prefilling the
context instead, and aggregate generated tok/s of 1 / 4 / 8 / 16 concurrent streams on
distinct contexts (as many as the GPU's slots hold). Build rows: the prefill alone, the
indexer's prefill + tables up to the artifact in host memory, and PutContext until READY.
`ctxcache bench serve --model random:llama-3.1-8b --device cuda --dtype bfloat16`; on a CPU the
defaults run the bundled SmolLM2 at 4K.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import random
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from ctxcache.bench.common.report import (RESULTS, commit, device_tag, machine_info, print_table, run_together,
                                          write_result)
from ctxcache.indexer import IndexerConfig, build_artifact
from ctxcache.methods import make_method
from ctxcache.models.attention import dense_attention
from ctxcache.models.loader import load_model
from ctxcache.client import Client
from ctxcache.service.config import (GiB, DecoderSettings, IndexerSettings, ModelConfig, ServerConfig,
                                     ServiceConfig, StoreSettings)
from ctxcache.client.gen.v1 import admin_pb2 as apb
from ctxcache.client.gen.v1 import context_pb2 as pb
from ctxcache.service.server import create_server

QUESTION = "Which of the facts above matters most? Answer in one line."  # ~20 tokens


def context_text(lm, n_tokens: int, seed: int) -> str:
    """Distinct filler of about n_tokens tokens under the model's tokenizer."""
    rng = random.Random(seed)
    words = [f"fact{rng.randrange(10**6)} is {rng.choice(['red', 'blue', 'green', 'odd', 'even'])}."
             for _ in range(n_tokens)]
    text, tok = " ".join(words), lm.tokenizer
    if tok is None:  # bytes tokenizer: one token per byte
        return text[:max(1, n_tokens - 16)]
    ids = tok.encode(text, add_special_tokens=False)[:max(1, n_tokens - 32)]
    return tok.decode(ids)


def timed_prefill(lm, n: int, chunk: int = 4096) -> float:
    """Seconds to prefill n tokens densely and take the first token (what serving without a
    cache does per request: the re-prefill TTFT)."""
    model, dev = lm.model, lm.model.lm_head.weight.device
    ids = torch.randint(3, 200, (1, n), device=dev)
    cache = model.new_cache(1, max_len=n + 1)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    with torch.inference_mode():
        sync()
        t0 = time.perf_counter()
        for s in range(0, n, chunk):
            part = ids[:, s:s + chunk]
            pos = cache.lengths[:, None] + torch.arange(part.shape[1], device=dev)
            logits = model(part, pos, cache, dense_attention, last_only=True)
            cache.lengths += part.shape[1]
        int(logits[0, -1].argmax())
        sync()
    return time.perf_counter() - t0


def generate(client: Client, cid: str, max_tokens: int) -> pb.Final:
    req = pb.GenerateRequest(context_id=cid, question=QUESTION, sampling=pb.SamplingParams(max_tokens=max_tokens))
    final = None
    for ev in client.generate(req, timeout=600):
        if ev.HasField("final"):
            final = ev.final
    return final


def _client_rate(address: str, cids: list[str], tokens: int) -> tuple[float, list[float], list[str], int]:
    """In the load process: one stream per context, all at once -> (wall seconds, per-stream
    tok/s, decode paths, generated tokens)."""
    client = Client(address)
    finals: list = [None] * len(cids)

    def one(i: int) -> None:
        finals[i] = generate(client, cids[i], tokens)

    try:
        wall = run_together([lambda i=i: one(i) for i in range(len(cids))])
    finally:
        client.close()
    return (wall, [f.timings.tokens_per_second for f in finals], [f.decode_path for f in finals],
            sum(f.usage.generated_tokens for f in finals))


def concurrent_rate(load: ProcessPoolExecutor, address: str, cids: list[str], tokens: int) -> tuple[float, float, str]:
    """Aggregate generated tok/s of one stream per context, all at once, and the mean per-stream
    tok/s. The client runs in its own process, as a user's would: client threads in the server's
    process would take the server's interpreter lock from the decode loop."""
    wall, rates, paths, made = load.submit(_client_rate, address, cids, tokens).result()
    if len(set(paths)) != 1:
        raise RuntimeError(f"streams were served by different paths: {sorted(set(paths))}")
    return made / wall, statistics.mean(rates), paths[0]


def ttft_tiers(server, client: Client, cid: str, repeats: int, drop_page_cache: bool) -> dict[str, list[float]]:
    """cold: evicted from DRAM and the device (admin Evict, memory only), read from LMDB;
    hot: resident on the device; warm: in DRAM, dropped from the device (the in-process
    server's runners, which no RPC reaches alone)."""
    tiers: dict[str, list[float]] = {"hot": [], "warm": [], "cold": []}
    for _ in range(repeats):
        client.admin.Evict(apb.EvictRequest(context_id=cid, memory_only=True))
        if drop_page_cache:
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
        tiers["cold"].append(generate(client, cid, 1).timings.ttft_seconds)
        tiers["hot"].append(generate(client, cid, 1).timings.ttft_seconds)
        for engine in server.decoder.engines:
            engine.runner.evict(cid)
        tiers["warm"].append(generate(client, cid, 1).timings.ttft_seconds)
    return tiers


def pctl(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def run_point(lm, args, mode: str, n_ctx: int, streams: list[int], data: Path) -> tuple[list[dict], dict]:
    slots = max(streams)
    cfg = ServiceConfig(
        server=ServerConfig(port=0, max_streams=max(16, slots), threads=64),
        model=ModelConfig(args.model, args.device, args.dtype),
        store=StoreSettings(data, int(args.store_gb * GiB)),
        indexer=IndexerSettings(store_queries=0, max_context_tokens=n_ctx + 64),
        decoder=DecoderSettings(dram_cache_bytes=int(args.dram_gb * GiB), decode_mode=mode,
                                gpu_slots=slots, gpu_slot_tokens=n_ctx + 64 + 256 + args.tokens))
    # before the server holds its slots: a long context's second cache may not fit beside them
    reprefill = [timed_prefill(lm, n_ctx + 20) for _ in range(args.repeats)]
    server, port = create_server(cfg, lm)
    client = Client(f"127.0.0.1:{port}")
    build, rows = {}, []
    try:
        cids, puts = [], []
        for i in range(slots):
            t0 = time.perf_counter()
            info = client.put(pb.PutContextRequest(text=context_text(lm, n_ctx, 1000 * n_ctx + i), wait=True),
                              timeout=3600).context
            puts.append(time.perf_counter() - t0)
            if info.state != pb.CONTEXT_STATE_READY:
                raise RuntimeError(f"PutContext failed: {info.error}")
            cids.append(info.context_id)
        build = {"context": n_ctx, "put_seconds": statistics.median(puts)}
        tiers = ttft_tiers(server, client, cids[0], args.repeats, args.drop_page_cache)
        tiers["reprefill"] = reprefill
        address = f"127.0.0.1:{port}"
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as load:
            for s in streams:  # first use of a batch size compiles kernels and captures its graph
                concurrent_rate(load, address, cids[:s], 4)
            for s in streams:
                agg, per, path = concurrent_rate(load, address, cids[:s], args.tokens)
                rows.append({"context": n_ctx, "streams": s, "mode": "csattention" if mode == "sparse" else "dense",
                             "decode_path": path, "aggregate_tokens_per_s": agg, "per_stream_tokens_per_s": per,
                             "ttft_p50_s": {k: statistics.median(v) for k, v in tiers.items()},
                             "ttft_p99_s": {k: pctl(v, 0.99) for k, v in tiers.items()}})
                print(rows[-1], flush=True)
    finally:
        client.close()
        server.stop(0)
    return rows, build


def build_times(lm, n_ctx: int) -> dict:
    """The indexer's prefill + tables to an artifact in host memory, beside the prefill alone."""
    tokens = torch.randint(3, 200, (n_ctx,))
    cfg = IndexerConfig(progress=False, store_queries=0,
                        kv_dtype="bfloat16" if lm.model.lm_head.weight.dtype == torch.bfloat16 else "float16")
    build_artifact(lm, tokens[:256], make_method("csattention"), cfg)  # warm-up
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    build_artifact(lm, tokens, make_method("csattention"), cfg)
    return {"index_seconds": time.perf_counter() - t0, "prefill_seconds": timed_prefill(lm, n_ctx)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ctxcache bench serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--contexts", default="4096", help="context lengths in tokens, comma separated")
    ap.add_argument("--streams", default="1,16", help="concurrent streams on distinct contexts, comma separated")
    ap.add_argument("--modes", default="sparse,dense")
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per stream")
    ap.add_argument("--repeats", type=int, default=3, help="TTFT samples per tier")
    ap.add_argument("--store-gb", type=float, default=40.0)
    ap.add_argument("--dram-gb", type=float, default=8.0)
    ap.add_argument("--drop-page-cache", action="store_true", help="cold TTFT after dropping the OS page cache (root)")
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    contexts = [int(x) for x in args.contexts.split(",")]
    streams = sorted(int(x) for x in args.streams.split(","))
    modes = args.modes.split(",")
    if any(m not in ("sparse", "dense") for m in modes):
        ap.error(f"--modes {args.modes!r}: each must be sparse or dense")
    lm = load_model(args.model, getattr(torch, args.dtype), args.device)
    rows, builds = [], []
    for n in contexts:
        fit = [s for s in streams if s <= args_slots_fit(lm, n, args)]
        b = build_times(lm, n)
        # one store per length: the later mode's server finds the first one's artifacts (the
        # server reconciles its registry from the store at start), so each context is built once
        with tempfile.TemporaryDirectory(prefix="ctxcache-bench-serve-") as tmp:
            for i, mode in enumerate(modes):
                got, put = run_point(lm, args, mode, n, fit, Path(tmp))
                rows += got
                if i == 0:
                    builds.append({**b, **put})
    info = machine_info()
    stamp = {"commit": commit(), "date": datetime.date.today().isoformat()}
    rows, builds = [{**r, **stamp} for r in rows], [{**b, **stamp} for b in builds]
    rows, builds = keep_other_lengths(Path(args.out) / f"serve_{device_tag(info)}.json", args, contexts, rows, builds)
    out = write_result("serve", {"device": (info.get("gpu") or {}).get("name") or info["cpu"], "model": args.model,
                                 "dtype": args.dtype, "tokens_per_stream": args.tokens, "rows": rows,
                                 "build": builds}, args.out)
    plot(rows, out.with_suffix(".png"))
    print_table([{**r, **{f"ttft_{k}": v for k, v in r["ttft_p50_s"].items()}} for r in rows],
                ["context", "streams", "mode", "aggregate_tokens_per_s", "per_stream_tokens_per_s",
                 "ttft_hot", "ttft_warm", "ttft_cold", "ttft_reprefill"])
    print_table(builds, ["context", "prefill_seconds", "index_seconds", "put_seconds"])
    print(f"wrote {out}")
    return 0


def keep_other_lengths(path: Path, args, contexts: list[int], rows: list[dict],
                       builds: list[dict]) -> tuple[list[dict], list[dict]]:
    """Rows of the earlier result for context lengths this run did not measure, when that run
    used the same model, dtype and tokens per stream (a long length needs a call of its own on
    the GPU machine). Every row names the commit and date of its run; ratios between modes are
    always within one run."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return rows, builds
    if (old.get("model"), old.get("dtype"), old.get("tokens_per_stream")) != (args.model, args.dtype, args.tokens):
        return rows, builds
    stamp = {"commit": old.get("commit"), "date": old.get("date")}
    kept = [{**stamp, **r} for r in old.get("rows", []) if r["context"] not in contexts]
    kept_builds = [{**stamp, **b} for b in old.get("build", []) if b["context"] not in contexts]
    by_length = lambda r: (r["context"], r.get("mode", ""), r.get("streams", 0))  # noqa: E731
    return sorted(kept + rows, key=by_length), sorted(kept_builds + builds, key=by_length)


def plot(rows: list[dict], path: Path) -> None:
    """Aggregate tok/s against concurrent streams, one line per context and mode."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for key in sorted({(r["context"], r["mode"]) for r in rows}):
        pts = sorted((r["streams"], r["aggregate_tokens_per_s"]) for r in rows if (r["context"], r["mode"]) == key)
        ax.plot(*zip(*pts), marker="o", linestyle="-" if key[1] == "csattention" else "--",
                label=f"{key[0] // 1024}K {key[1]}")
    ax.set(xlabel="concurrent streams (distinct contexts)", ylabel="aggregate generated tok/s",
           title="ctxcache serve through gRPC")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def args_slots_fit(lm, n_ctx: int, args) -> int:
    """Streams whose slots fit the GPU beside the weights (every stream count on a CPU)."""
    if args.device != "cuda":
        return 1 << 30
    a = lm.args
    tokens = n_ctx + 64 + 256 + args.tokens
    kv = 2 * a.n_layers * a.n_kv_heads * a.head_dim * tokens * 2
    tables = a.n_layers * a.n_kv_heads * 8 * 128 * (tokens + 4 * 512)  # int8 rows + fp32 overlay
    # the driver's free memory plus what the caching allocator holds unused (the load's fp32 copies)
    free = torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    fit = max(1, int((free - 6 * GiB) // (kv + tables)))  # 6 GiB: graphs, selector and prefill scratch
    print(f"{n_ctx} tokens: {fit} slots fit in {free / GiB:.1f} GiB free ({(kv + tables) / GiB:.1f} GiB each)")
    return fit


if __name__ == "__main__":
    raise SystemExit(main())
