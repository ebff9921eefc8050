"""`ctxcache bench service`: the service end to end on the default model (CPU).

Measured in one run, through real gRPC on 127.0.0.1: TTFT for a cached ~4K-token context
(artifact already in DRAM, and cold from the store) vs re-prefilling the same context +
question with dense attention; artifact load time; artifact bytes / raw KV bytes; Generate
throughput with 1, 4 and 16 concurrent streams. Prints a table, writes <out>/service_<device>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ctxcache.bench.common.report import run_together, write_result

QUESTION = "In one sentence, what does this license say about distributing modified versions?"


def _context_text(tokenizer, n_tokens: int) -> str:
    from ctxcache.bench.common.texts import builtin_text

    text = builtin_text("prose")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    while len(ids) < n_tokens:
        ids = ids + ids
    return tokenizer.decode(ids[:n_tokens])


def _ask(client, pb, cid: str, max_tokens: int):
    req = pb.GenerateRequest(context_id=cid, question=QUESTION, sampling=pb.SamplingParams(max_tokens=max_tokens))
    return [e for e in client.generate(req, timeout=600)][-1].final


def _reprefill_ttft(lm, prompter, context, turn) -> float:
    """Dense prefill of the whole conversation from nothing, then the first token."""
    from ctxcache.generation import prefill, sample, SamplingParams
    from ctxcache.models.attention import dense_attention

    ids = prompter.context_tokens(context) + prompter.turn_tokens(context, turn)
    t0 = time.perf_counter()
    cache = lm.model.new_cache(1, max_len=len(ids) + 1)
    logits = prefill(lm.model, torch.tensor([ids]), cache, dense_attention)
    sample(logits, SamplingParams(), None)
    return time.perf_counter() - t0


def _throughput(client, pb, cid: str, streams: int, max_tokens: int) -> dict:
    finals, errors = [], []

    def one() -> None:
        try:
            finals.append(_ask(client, pb, cid, max_tokens))
        except Exception as exc:  # noqa: BLE001 - recorded in the result
            errors.append(repr(exc))

    wall = run_together([one] * streams)
    tokens = sum(f.usage.generated_tokens for f in finals)
    return {"streams": streams, "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "mean_ttft_s": statistics.mean(f.timings.ttft_seconds for f in finals) if finals else None,
            "errors": errors}


def run(args) -> dict:
    from ctxcache.models.loader import load_model
    from ctxcache.service.client import Client
    from ctxcache.service.config import (GiB, IndexerSettings, ModelConfig, ServerConfig, ServiceConfig,
                                         StoreSettings)
    from ctxcache.service.gen.v1 import admin_pb2 as apb, context_pb2 as pb
    from ctxcache.service.prompting import Prompter, text_messages
    from ctxcache.service.server import create_server

    lm = load_model(args.model)
    prompter = Prompter(lm.tokenizer)
    text = _context_text(lm.tokenizer, args.tokens)
    cfg = ServiceConfig(server=ServerConfig(port=0, max_streams=32, threads=64), model=ModelConfig(args.model),
                        store=StoreSettings(Path(tempfile.mkdtemp(prefix="ctxcache-bench-")), 8 * GiB),
                        indexer=IndexerSettings(method=args.method, method_params=json.loads(args.params)))
    server, port = create_server(cfg, lm)
    client = Client(f"127.0.0.1:{port}")
    out: dict = {"model": lm.model_id, "method": args.method, "method_params": json.loads(args.params)}
    try:
        t0 = time.perf_counter()
        info = client.put(pb.PutContextRequest(text=text, wait=True), timeout=3600).context
        out.update(build_s=time.perf_counter() - t0, context_tokens=info.n_tokens,
                   artifact_bytes=info.artifact_bytes, raw_kv_bytes=info.raw_kv_bytes,
                   artifact_over_raw_kv=info.artifact_bytes / info.raw_kv_bytes)
        cold = _ask(client, pb, info.context_id, 1)
        out.update(cold_ttft_s=cold.timings.ttft_seconds, load_s=cold.timings.load_seconds,
                   question_tokens=cold.usage.new_prompt_tokens)
        warm = [_ask(client, pb, info.context_id, 1).timings.ttft_seconds for _ in range(args.repeats)]
        out.update(cached_ttft_s=statistics.median(warm), cached_ttft_all_s=warm)
        turn = [{"role": "user", "content": QUESTION}]
        out["reprefill_ttft_s"] = _reprefill_ttft(lm, prompter, text_messages(text), turn)
        out["stored_bytes_by_part"] = _stored_parts(server, info.context_id)
        out["throughput"] = []
        for n in (1, 4, 16):
            steps0, rows0 = server.decoder.engines[0].steps, server.decoder.engines[0].rows_stepped
            t = _throughput(client, pb, info.context_id, n, args.max_tokens)
            steps = server.decoder.engines[0].steps - steps0
            t["mean_decode_batch"] = (server.decoder.engines[0].rows_stepped - rows0) / steps if steps else 0.0
            out["throughput"].append(t)
        out["stats"] = str(client.admin.Stats(apb.StatsRequest())).replace("\n", "; ")
    finally:
        client.close()
        server.stop(1)
    return out


def _stored_parts(server, cid: str) -> dict:
    """Stored (compressed) bytes of the artifact by part: K/V, index tables, query sample."""
    parts = {"kv": 0, "tables": 0, "queries": 0, "other": 0}
    for c in server.backend.manifest(cid).chunks:
        kind = "kv" if c.name in ("k", "v") else "tables" if c.name.startswith("t_") else \
            "queries" if c.name == "q" else "other"
        parts[kind] += c.stored_bytes
    return parts


def table(r: dict) -> str:
    rows = [("context tokens (+ question tokens)", f"{r['context_tokens']} (+{r['question_tokens']})"),
            ("build (prefill + index + store)", f"{r['build_s']:.1f} s"),
            ("artifact bytes / raw KV bytes", f"{r['artifact_bytes'] / 1e6:.1f} MB / {r['raw_kv_bytes'] / 1e6:.1f} MB "
                                              f"= {r['artifact_over_raw_kv']:.2f}"),
            ("  of which K/V, tables, query sample", " / ".join(
                f"{r['stored_bytes_by_part'][k] / 1e6:.1f} MB" for k in ("kv", "tables", "queries"))),
            ("artifact load (store -> DRAM)", f"{r['load_s']:.3f} s"),
            ("TTFT cold (load + question + 1st token)", f"{r['cold_ttft_s']:.3f} s"),
            ("TTFT cached (DRAM hit), median", f"{r['cached_ttft_s']:.3f} s  (target <= 0.3 s)"),
            ("TTFT re-prefill (dense, same run)", f"{r['reprefill_ttft_s']:.2f} s")]
    rows += [(f"Generate, {t['streams']} concurrent stream(s)",
              f"{t['tokens_per_s']:.1f} tok/s total, mean TTFT {t['mean_ttft_s']:.2f} s, "
              f"mean decode batch {t['mean_decode_batch']:.1f}"
              + (f", {len(t['errors'])} errors" if t["errors"] else "")) for t in r["throughput"]]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"| {k:<{width}} | {v} |" for k, v in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ctxcache bench service", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results", help="folder of the result JSON")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--method", default="csattention")
    ap.add_argument("--params", default="{}", help='JSON method parameters, e.g. {"table_dtype": "float16"}')
    ap.add_argument("--tokens", type=int, default=4000, help="context length in tokens")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens per stream in the throughput runs")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default, one per core)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = {"args": vars(args), **run(args)}
    print(table(result))
    print(f"wrote {write_result('service', result, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
