"""The product path under load: a `ctxcache serve` process and a gRPC client in one run.

For each decode mode (csattention, then the same engine with every layer dense) and context
length: PutContext of as many distinct contexts as streams need, TTFT of a 20-token question
with the context hot in HBM, warm in DRAM and cold in LMDB, the TTFT of re-prefilling the
context instead, and aggregate generated tok/s of 1 / 4 / 8 / 16 concurrent streams on
distinct contexts (as many as the GPU's slots hold). Build rows: the prefill alone, the
indexer's prefill + tables up to the artifact in host memory, and PutContext until READY.
With --hbm-gb, both modes get the same HBM for resident contexts (`serve --gpu-memory-gb`):
each holds as many slots as fit its mode's bytes per context, is measured at its own maximum
too, and the capacity table compares each mode's best aggregate tok/s. Mode `offload`: a sparse
server with one small slot and `--offload` with a host slot per stream (`--offload-slots`), so every
context decodes with its V in host memory (and K, with `--offload-k host`), all streams in one
batched step; its rows add the bytes over PCIe per step (admin Stats, over the measured runs), the
link's pinned host -> device rate measured here, and its aggregate over the resident sparse row's
of the same run (`--modes sparse,offload,dense`).
The server runs as a user runs it (`python -m ctxcache.service serve` on a free port, ready on
gRPC health) and is read through its API alone (admin Evict for the tiers); the prefill, build
and re-prefill rows run on this process's own copy of the model first, freed before a server
starts. `ctxcache bench serve --model random:llama-3.1-8b --device cuda --dtype bfloat16`; on a
CPU the defaults run the bundled SmolLM2 at 4K.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ctxcache.bench.common.report import add_out, commit
from ctxcache.bench.common.reprefill import reprefill_seconds
from ctxcache.client.server_process import running_server
from ctxcache.bench.common.serve_client import admission, concurrent_rate, generate, pctl
from ctxcache.bench.common.serve_report import ROW_NAME, report
from ctxcache.bench.common.serve_limits import (copy_bandwidth, floor_ms, h2d_gb_per_s, row_bytes, runner_steps_ms,
                                                weight_bytes)
from ctxcache.quality.texts import text_of_tokens
from ctxcache.client import Client
from ctxcache.client.gen.v1 import admin_pb2 as apb
from ctxcache.client.gen.v1 import context_pb2 as pb
from ctxcache.decoder.gpu.capacity import MAX_NEW, free_bytes, offload_row_bytes, slot_bytes
from ctxcache.decoder.gpu.offload_runner import ALIGN
from ctxcache.decoder.reference_attention import SparseConfig
from ctxcache.indexer import IndexerConfig, build_artifact, prefill_chunk
from ctxcache.methods import make_method
from ctxcache.models.loader import load_model

GiB = 1 << 30
# --modes: the server's decode mode (offload: sparse, its contexts in host slots)
DECODE_MODE = {"sparse": "sparse", "offload": "sparse", "dense": "dense"}
SERVER_SCHEDULE = SparseConfig.from_schedule("0.05-step-1")  # serve's default --schedule


@dataclass
class Point:
    """One context length, measured on the model in this process before any server runs."""
    n_ctx: int
    streams: dict[str, list[int]]  # per mode: the stream counts whose slots fit
    texts: list[str]  # one distinct context per slot
    reprefill: list[float]  # seconds, one per repeat
    build: dict  # prefill and index seconds
    runner_ms: dict[str, dict[int, float]]  # per mode and stream count: GpuRunner.step alone
    prefill_ms: dict[str, float]  # per mode: GpuRunner.admit of a question on a resident slot alone
    weights: int  # bytes every step reads once
    bandwidth: float  # the card's measured copy bandwidth, bytes/s
    row_bytes: dict[str, int]  # per mode: K/V-side bytes one step reads per row
    h2d_gb_per_s: float | None = None  # with --offload on a GPU: the pinned host -> device copy rate
    slots_fit: dict[str, int] | None = None  # per mode (sparse too with offload): contexts the free HBM holds


def context_text(tokenizer, n_tokens: int, seed: int) -> str:
    """Distinct filler of about n_tokens tokens under the model's tokenizer (32 left for the
    chat template's wrapping)."""
    rng = random.Random(seed)
    words = [f"fact{rng.randrange(10**6)} is {rng.choice(['red', 'blue', 'green', 'odd', 'even'])}."
             for _ in range(n_tokens)]
    return text_of_tokens(tokenizer, " ".join(words), max(1, n_tokens - 32))


def ttft_tiers(client: Client, cid: str, repeats: int, drop_page_cache: bool) -> dict[str, list[float]]:
    """cold: evicted from DRAM and the device (admin Evict memory_only), read from LMDB; hot:
    resident on the device; warm: in DRAM, its device slots released (admin Evict device_only)."""
    tiers: dict[str, list[float]] = {"hot": [], "warm": [], "cold": []}
    for _ in range(repeats):
        client.admin.Evict(apb.EvictRequest(context_id=cid, memory_only=True))
        if drop_page_cache:
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
        tiers["cold"].append(generate(client, cid, 1).timings.ttft_seconds)
        tiers["hot"].append(generate(client, cid, 1).timings.ttft_seconds)
        client.admin.Evict(apb.EvictRequest(context_id=cid, device_only=True))
        tiers["warm"].append(generate(client, cid, 1).timings.ttft_seconds)
    return tiers


def slot_tokens(n_ctx: int, args) -> int:
    """A slot holds the context, the question (with its template) and the answer."""
    return n_ctx + 64 + 256 + args.tokens


def server_flags(args, mode: str, point: Point, data: Path) -> list[str]:
    """`ctxcache serve` flags of one mode at one length: a slot per stream (or, with --hbm-gb, as
    many slots as that HBM holds in the mode)."""
    slots = max(point.streams[mode])
    sizing = ["--gpu-memory-gb", str(args.hbm_gb)] if args.hbm_gb else ["--gpu-slots", str(slots)]
    tokens = slot_tokens(point.n_ctx, args)
    if mode == "offload":  # one small slot: every context decodes offloaded, a host slot a stream
        sizing = ["--gpu-slots", "1", "--offload", "--offload-slots", str(slots), "--offload-slot-tokens", str(tokens),
                  "--offload-k", args.offload_k, "--offload-v-cache", str(args.offload_v_cache)]
        sizing += ["--offload-prefill-graphs" if args.offload_prefill_graphs else "--no-offload-prefill-graphs"]
        tokens = 1024
    return ["--model", args.model, "--device", args.device, "--dtype", args.dtype, "--data", str(data),
            "--store-budget-gb", str(args.store_gb), "--dram-cache-gb", str(args.dram_gb), "--decode-mode", DECODE_MODE[mode],
            "--max-streams", str(max(16, slots)), "--gpu-slot-tokens", str(tokens),
            "--method-params", args.method_params, *sizing]


def put_all(client: Client, texts: list[str]) -> tuple[list[str], list[float]]:
    """PutContext (wait) of each text; -> context ids, seconds each."""
    cids, puts = [], []
    for text in texts:
        t0 = time.perf_counter()
        info = client.put(pb.PutContextRequest(text=text, wait=True), timeout=3600).context
        puts.append(time.perf_counter() - t0)
        if info.state != pb.CONTEXT_STATE_READY:
            raise RuntimeError(f"PutContext failed: {info.error}")
        cids.append(info.context_id)
    return cids, puts


def run_point(args, mode: str, point: Point, data: Path) -> tuple[list[dict], dict]:
    log = data.parent / f"serve-{mode}.log"
    with running_server(server_flags(args, mode, point, data), log) as address:
        client = Client(address)
        try:
            got = measure(client, args, mode, point)
            slow = [line for line in log.read_text().splitlines()
                    if any(what in line for what in ("slow admission", "after warm-up", "slow gc", "prefill graph"))]
            print(f"--- the {mode} server's slow admissions ({len(slow)}):\n" + "\n".join(slow[-12:]), flush=True)
            return got
        except Exception:
            print(f"--- the {mode} server's last output:\n" + "\n".join(log.read_text().splitlines()[-40:]), flush=True)
            raise
        finally:
            client.close()


def measure(client: Client, args, mode: str, point: Point) -> tuple[list[dict], dict]:
    cids, puts = put_all(client, point.texts)  # every mode's texts: the first server builds them all
    build = {"context": point.n_ctx, "method_params": args.method_params, "index": index_name(args),
             "put_seconds": statistics.median(puts)}
    stats = client.admin.Stats(apb.StatsRequest())
    streams = point.streams[mode]
    if args.device == "cuda" and mode != "offload" and stats.device_slots != max(streams):
        raise RuntimeError(f"{mode}: the server holds {stats.device_slots} slots, this bench sized {max(streams)}")
    tiers = {**ttft_tiers(client, cids[0], args.repeats, args.drop_page_cache), "reprefill": point.reprefill}
    rows = []
    for s in streams:  # the server compiled and captured every batch size before SERVING
        # a first round puts the contexts in their slots (loads, not decoding: the median of three
        # with it was the slower of two decoding rounds), then the measured rounds
        first = concurrent_rate(client, cids[:s], args.tokens)
        before = client.admin.Stats(apb.StatsRequest())
        runs = [concurrent_rate(client, cids[:s], args.tokens) for _ in range(args.rate_repeats)]
        agg, per, path, _, _ = sorted(runs, key=lambda r: r[0])[len(runs) // 2]  # the median run
        name = ROW_NAME[mode]
        rows.append({"context": point.n_ctx, "streams": s, "mode": name,
                     "decode_path": path, "aggregate_tokens_per_s": agg, "per_stream_tokens_per_s": per,
                     "aggregate_runs": [r[0] for r in runs], "run_starts": [r[4] for r in runs],
                     "loading_run": {"aggregate_tokens_per_s": first[0], **first[4]},
                     **limits_of(point, mode, s, agg, per, [g for r in runs for g in r[3]]),
                     "slots": stats.device_slots, "slot_gib": stats.device_slot_bytes / GiB,
                     "hbm_gib": args.hbm_gb, "method_params": args.method_params, "index": index_name(args),
                     "ttft_p50_s": {k: statistics.median(v) for k, v in tiers.items()},
                     "ttft_p99_s": {k: pctl(v, 0.99) for k, v in tiers.items()}})
        if mode == "offload":  # since the server started (every run of this length so far)
            now = client.admin.Stats(apb.StatsRequest())
            rows[-1].update(offload_hit_rate=now.offload_hit_rate, resident_contexts=now.resident_contexts,
                            offloaded_contexts=now.offloaded_contexts, offload_k=args.offload_k,
                            offload_v_cache=args.offload_v_cache, offload_prefill_graphs=args.offload_prefill_graphs,
                            **slots_fit_of(point, args),
                            **pcie_of(before, now, point.h2d_gb_per_s))
        print(rows[-1], flush=True)
    if len(cids) >= 8:
        rows[-1]["admission"] = {**admission(client, cids[:8], args.tokens), "runner_prefill_ms": point.prefill_ms.get(mode)}
        print(rows[-1]["admission"], flush=True)
    return rows, build


def slots_fit_of(point: Point, args) -> dict:
    """The contexts the card's free HBM holds offloaded and resident (on a CPU none: no bound)."""
    fit = point.slots_fit if args.device == "cuda" and point.slots_fit else {}
    return {"offload_slots_fit": fit.get("offload"), "resident_slots_fit": fit.get("sparse")}


def pcie_of(before, now, h2d_gb_per_s: float | None) -> dict:
    """The offload runner's bytes over PCIe per step over the measured runs (steps of every row
    of the bucket, the warm-up and loading round excluded), and what the link's measured rate
    makes of them."""
    steps = now.offload_steps - before.offload_steps
    per_step = (now.offload_pcie_bytes - before.offload_pcie_bytes) / steps if steps else None
    ms = per_step / (h2d_gb_per_s * 1e9) * 1e3 if per_step is not None and h2d_gb_per_s else None
    return {"pcie_bytes_per_step": per_step, "offload_steps": steps, "h2d_gb_per_s": h2d_gb_per_s,
            "pcie_ms_per_step_at_h2d": ms}


def limits_of(point: Point, mode: str, s: int, agg: float, per: float, gaps: list[float]) -> dict:
    """The row's floor, the runner's own step at this batch, and the client's inter-token gaps (their
    mean is the served decode step without the TTFT: beside the runner's step, what serving adds or
    saves; the median splits sparse's alternating full and lean steps)."""
    step = point.runner_ms.get(mode, {}).get(s)
    floor = floor_ms(point.weights, point.row_bytes[mode], s, point.bandwidth)
    served = 1e3 * s / agg if agg else 0.0  # ms per step as the streams saw it
    return {"runner_step_ms": step, "served_of_runner": per * step / 1e3 if step else None,
            "served_step_ms": served, "floor_ms": floor, "floor_fraction": floor / served if served else None,
            "itl_p50_ms": statistics.median(gaps) if gaps else None, "itl_p99_ms": pctl(gaps, 0.99) if gaps else None,
            "itl_mean_ms": statistics.fmean(gaps) if gaps else None}


def build_times(lm, n_ctx: int, method_params: dict) -> dict:
    """The indexer's prefill + tables to an artifact in host memory, beside the prefill alone."""
    tokens = torch.randint(3, 200, (n_ctx,))
    on_gpu = lm.model.lm_head.weight.is_cuda
    cfg = IndexerConfig(prefill_chunk(on_gpu), progress=False, store_queries=0, coded_kv=True,  # as PutContext
                        kv_dtype="bfloat16" if lm.model.lm_head.weight.dtype == torch.bfloat16 else "float16")
    method = make_method("csattention", method_params)
    build_artifact(lm, tokens[:256], method, cfg)  # warm-up
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    art = build_artifact(lm, tokens, method, cfg)
    return {"index_seconds": time.perf_counter() - t0, "prefill_seconds": reprefill_seconds(lm, n_ctx, 4096)}, art


def points_on_the_model(args, contexts: list[int], streams: list[int]) -> list[Point]:
    """What this process measures on its own copy of the model, for every length, before any
    server starts; the copy is freed on return, so a server's weights and slots fit beside it."""
    lm = load_model(args.model, getattr(torch, args.dtype), args.device)
    bandwidth = copy_bandwidth(args.device)
    h2d = None
    if "offload" in args.modes.split(",") and args.device == "cuda":
        h2d = h2d_gb_per_s()
    points = []
    for n in contexts:
        modes = args.modes.split(",")
        # the resident slots beside the offloaded streams: how many more contexts offloading decodes
        slots = {mode: mode_slots(lm, n, args, mode) for mode in dict.fromkeys(
            modes + (["sparse"] if "offload" in modes else []))}
        fit = {mode: mode_streams(slots[mode], n, args, mode, streams) for mode in modes}
        texts = [context_text(lm.tokenizer, n, 1000 * n + i) for i in range(max(max(s) for s in fit.values()))]
        build, art = build_times(lm, n, json.loads(args.method_params))
        reprefill = [reprefill_seconds(lm, n + 20, 4096) for _ in range(args.repeats)]  # + the question
        sparse = make_method("csattention", json.loads(args.method_params)).params
        params = {"sparse": sparse, "offload": sparse, "dense": None}
        config = SERVER_SCHEDULE
        elem = lm.model.lm_head.weight.element_size()
        alone = ({mode: runner_steps_ms(lm, art, params[mode], config, fit[mode], slot_tokens(n, args))
                  for mode in fit if mode != "offload"} if args.device == "cuda" else {})  # resident runners
        runner_ms, prefill_ms = {m: a[0] for m, a in alone.items()}, {m: a[1] for m, a in alone.items()}
        points.append(Point(n, fit, texts, reprefill, build, runner_ms, prefill_ms, weight_bytes(lm), bandwidth,
                            {mode: row_bytes(lm.args, params[mode], config, n, elem) for mode in params}, h2d, slots))
        del art
    return points


def mode_streams(slots: int, n_ctx: int, args, mode: str, streams: list[int]) -> list[int]:
    """The --streams counts the mode's `slots` hold, and with --hbm-gb the mode's maximum too."""
    fit = [s for s in streams if s <= slots]
    if args.hbm_gb:
        fit = sorted({*fit, slots})
    if not fit:
        raise ValueError(f"{n_ctx} tokens: no --streams count in {streams} fits the GPU's free memory ({mode})")
    return fit


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
    ap.add_argument("--rate-repeats", type=int, default=3,
                    help="measurements of each stream count after a first round that loads the contexts (median kept)")
    ap.add_argument("--store-gb", type=float, default=40.0)
    ap.add_argument("--dram-gb", type=float, default=8.0,
                    help="the server's DRAM artifact cache (a context resident in a GPU slot does not need it; "
                         "8 x 32K int8 contexts are 17 GB)")
    ap.add_argument("--hbm-gb", type=float, default=0.0,
                    help="HBM for resident contexts, the same for every mode (serve --gpu-memory-gb); 0: a slot "
                         "per stream, as many as the free memory holds")
    ap.add_argument("--offload-k", choices=("hbm", "host"), default="hbm",
                    help="mode offload: each context's K in HBM (serve --offload-k hbm) or read from the host")
    ap.add_argument("--offload-v-cache", type=float, default=8.0,
                    help="mode offload: serve --offload-v-cache (a host slot's GPU cache of V rows, in selections)")
    ap.add_argument("--offload-prefill-graphs", action=argparse.BooleanOptionalAction, default=True,
                    help="mode offload: serve --[no-]offload-prefill-graphs (hot questions' prefills replayed as CUDA graphs)")
    ap.add_argument("--method-params", default="{}", help="CSAttention parameters of the server (JSON)")
    ap.add_argument("--drop-page-cache", action="store_true", help="cold TTFT after dropping the OS page cache (root)")
    add_out(ap, what="the result JSON and PNG")
    args = ap.parse_args(argv)
    contexts = [int(x) for x in args.contexts.split(",")]
    streams = sorted(int(x) for x in args.streams.split(","))
    modes = args.modes.split(",")
    if any(m not in ROW_NAME for m in modes):
        ap.error(f"--modes {args.modes!r}: each must be sparse, offload or dense")
    points = points_on_the_model(args, contexts, streams)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the freed weights back to the driver, for the server's process
    rows, builds = [], []
    for point in points:
        # one store per length: the later mode's server finds the first one's artifacts (the
        # server reconciles its registry from the store at start), so each context is built once
        with tempfile.TemporaryDirectory(prefix="ctxcache-bench-serve-") as tmp:
            for i, mode in enumerate(modes):
                got, put = run_point(args, mode, point, Path(tmp) / "data")
                rows += got
                if i == 0:
                    builds.append({**point.build, **put})
    stamp = {"commit": commit(), "date": datetime.date.today().isoformat()}
    rows, builds = [{**r, **stamp} for r in rows], [{**b, **stamp} for b in builds]
    report(args, rows, builds, {(c, index_name(args)) for c in contexts})
    return 0


def index_name(args) -> str:
    """The server's CSAttention index as subspaces x centroids (what --method-params made of the defaults)."""
    p = make_method("csattention", json.loads(args.method_params)).params
    return f"{p.subspaces}x{p.centroids}"


def mode_slots(lm, n_ctx: int, args, mode: str) -> int:
    """Slots of the mode within --hbm-gb, or within the GPU's free memory beside the weights
    (every stream count on a CPU); the server sizes --gpu-memory-gb the same way."""
    if args.device != "cuda":
        return 1 << 30
    params = make_method("csattention", json.loads(args.method_params)).params if mode != "dense" else None
    tokens, elem = slot_tokens(n_ctx, args), lm.model.lm_head.weight.element_size()
    each = slot_bytes(lm.args, params, tokens, MAX_NEW, elem)
    if mode == "offload":  # an offloaded stream keeps its index, K (--offload-k hbm) and V cache on the GPU
        max_len = -(-tokens // ALIGN) * ALIGN  # as OffloadRunner rounds its host slots
        cached = min(max_len, math.ceil(args.offload_v_cache * SERVER_SCHEDULE.budget.top_k(max_len)))
        each = offload_row_bytes(lm.args, params, max_len, MAX_NEW, elem, cached, k_hbm=args.offload_k == "hbm")
    # the driver's free memory plus what the caching allocator holds unused (the load's fp32 copies),
    # with this process's weights loaded: the server's process holds the same once these are freed
    free = free_bytes()
    budget = args.hbm_gb * GiB if args.hbm_gb else free - 6 * GiB  # 6 GiB: graphs, selector, prefill scratch
    fit = max(1, int(budget // each))
    print(f"{n_ctx} tokens, {mode}: {fit} slots of {each / GiB:.2f} GiB in {budget / GiB:.1f} GiB "
          f"({free / GiB:.1f} GiB free)")
    return fit


if __name__ == "__main__":
    raise SystemExit(main())
