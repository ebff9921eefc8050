"""`ctxcache bench fleet`: one cache, many workers. Real `ctxcache serve` processes (one
indexer, N decoders) on a private redis-server and a private S3 server (SeaweedFS), measured
through gRPC only.

In one run:
- a context built through decoder 1 (the indexer builds it into the object store), then asked
  on decoder N, which never saw it: the cold load from the object store to the first token,
  against re-prefilling the same prompt densely (the model in this process); then the same
  decoder from its local store (after an Evict from DRAM) and from DRAM;
- with --streams S > 0: aggregate tok/s of decoder 1 alone, then of all N decoders at once,
  S streams each on distinct contexts (with --device cuda, decoder i on GPU i mod the GPUs,
  the indexer on GPU 0).
Prints a table, writes <out>/fleet_<device>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ctxcache.bench.common.fleet_servers import private_redis, private_s3
from ctxcache.bench.common.report import add_out, run_together, write_result
from ctxcache.bench.common.reprefill import reprefill_seconds
from ctxcache.bench.common.server import running_server
from ctxcache.bench.common.texts import builtin_text, text_of_tokens
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
             "--max-streams", "64", "--store-budget-gb", "64"]
    return flags + (["--threads", str(args.threads)] if args.threads else [])


def _gpu_env(args, i: int) -> dict[str, str] | None:
    n = torch.cuda.device_count() if args.device.startswith("cuda") else 0
    return {"CUDA_VISIBLE_DEVICES": str(i % n)} if n else None


def run(args) -> dict:
    from ctxcache.models.loader import load_model

    lm = load_model(args.model, getattr(torch, args.dtype), args.device)  # the text's tokens; re-prefill
    text = text_of_tokens(lm.tokenizer, builtin_text("prose"), args.tokens)
    with tempfile.TemporaryDirectory(prefix="ctxcache-fleet-") as tmp, contextlib.ExitStack() as stack:
        root = Path(tmp)
        redis = args.redis or stack.enter_context(private_redis(root))
        store = args.object_store or stack.enter_context(private_s3(root))
        start = time.perf_counter()
        stack.enter_context(running_server(_worker_flags(args, "indexer", root / "ix", redis, store),
                                           root / "indexer.log", env=_gpu_env(args, 0)))
        decoders = [Client(stack.enter_context(running_server(
            _worker_flags(args, "decoder", root / f"d{i}", redis, store), root / f"decoder{i}.log",
            env=_gpu_env(args, i)))) for i in range(args.decoders)]
        out = {"store": store.split("?")[0], "startup_s": time.perf_counter() - start}
        try:
            out.update(_tiers(decoders[0], decoders[-1], lm, text, args.repeats))
            if args.streams:
                out["throughput"] = _scaling(decoders, text, args)
        finally:
            for c in decoders:
                c.close()
        return out


def _tiers(first: Client, last: Client, lm, text: str, repeats: int) -> dict:
    t0 = time.perf_counter()
    info = _put(first, text)
    out = {"model": info.model_id, "context_tokens": info.n_tokens, "build_s": time.perf_counter() - t0,
           "artifact_bytes": info.artifact_bytes}
    cold = _ask(last, info.context_id, 1)  # `last` never loaded it: object store -> LMDB -> DRAM
    out.update(cold_ttft_s=cold.timings.ttft_seconds, cold_load_s=cold.timings.load_seconds,
               question_tokens=cold.usage.new_prompt_tokens, cold_decode_path=cold.decode_path)
    local = []
    for _ in range(repeats):
        last.admin.Evict(apb.EvictRequest(context_id=info.context_id, memory_only=True))
        local.append(_ask(last, info.context_id, 1).timings.ttft_seconds)
    hot = [_ask(last, info.context_id, 1).timings.ttft_seconds for _ in range(repeats)]
    out.update(local_ttft_s=statistics.median(local), hot_ttft_s=statistics.median(hot))
    out["reprefill_ttft_s"] = reprefill_seconds(lm, cold.usage.cached_tokens + cold.usage.new_prompt_tokens)
    return out


def _scaling(decoders: list[Client], text: str, args) -> list[dict]:
    """S streams per decoder, each on its own context (built first, then loaded once)."""
    ids = [[_put(decoders[0], f"Copy {d}.{s}.\n{text}").context_id for s in range(args.streams)]
           for d in range(len(decoders))]
    for d, c in enumerate(decoders):
        for cid in ids[d]:
            _ask(c, cid, 1)  # in DRAM (and on the device) before the timed runs
    return [_throughput(decoders[:n], ids[:n], args.max_tokens) for n in sorted({1, len(decoders)})]


def _throughput(decoders: list[Client], ids: list[list[str]], max_tokens: int) -> dict:
    finals: list[pb.Final] = []
    jobs = [lambda c=c, cid=cid: finals.append(_ask(c, cid, max_tokens)) for c, cs in zip(decoders, ids) for cid in cs]
    wall = run_together(jobs)
    tokens = sum(f.usage.generated_tokens for f in finals)
    return {"decoders": len(decoders), "streams": len(jobs), "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "completed": len(finals)}


def table(r: dict) -> str:
    rows = [("context tokens (+ question tokens)", f"{r['context_tokens']} (+{r['question_tokens']})"),
            ("build through a decoder (indexer: prefill + index + object store)", f"{r['build_s']:.1f} s"),
            ("artifact bytes", f"{r['artifact_bytes'] / 1e6:.1f} MB"),
            ("TTFT cold from the object store (another decoder)", f"{r['cold_ttft_s']:.3f} s "
                                                                  f"(load {r['cold_load_s']:.3f} s)"),
            ("TTFT re-prefill (dense, same run)", f"{r['reprefill_ttft_s']:.3f} s"),
            ("TTFT from the decoder's local store, median", f"{r['local_ttft_s']:.3f} s"),
            ("TTFT hot (DRAM), median", f"{r['hot_ttft_s']:.3f} s")]
    rows += [(f"{t['decoders']} decoder(s), {t['streams']} streams on distinct contexts",
              f"{t['tokens_per_s']:.1f} tok/s aggregate ({t['completed']}/{t['streams']} completed)")
             for t in r.get("throughput", [])]
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
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads of each worker (0: torch's default)")
    ap.add_argument("--redis", default=None, help="an existing redis://... (default: a private redis-server)")
    ap.add_argument("--object-store", default=None, help="an existing s3://... or file:///... "
                    "(default: a private SeaweedFS)")
    args = ap.parse_args(argv)
    if args.decoders < 1 or args.streams < 0 or args.tokens < 16:
        ap.error(f"--decoders {args.decoders} must be >= 1, --streams {args.streams} >= 0, --tokens >= 16")
    result = {"args": vars(args), **run(args)}
    print(table(result))
    print(f"wrote {write_result('fleet', result, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
