"""`ctxcache bench service`: the service end to end on the default model (CPU).

Measured in one run against a `ctxcache serve` process on 127.0.0.1, through its gRPC API
only: TTFT for a cached ~4K-token context (artifact already in DRAM, and cold from the store)
vs re-prefilling a prompt of the same length with dense attention (the model in this process);
artifact load time; artifact bytes / raw KV bytes and the stored bytes by part (admin
Describe); Generate throughput and mean decode batch (admin Stats) with 1, 4 and 16 concurrent
streams, and llama.cpp's one-stream tok/s on the same GGUF and context where llama-cpp-python
or llama-bench is installed (the table says so where not). Prints a table, writes
<out>/service_<device>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ctxcache.bench.common.report import add_out, run_together, write_result
from ctxcache.bench.common.reprefill import reprefill_seconds
from ctxcache.client.server_process import running_server
from ctxcache.quality.texts import builtin_text, text_of_tokens
from ctxcache.client import Client
from ctxcache.client.gen.v1 import admin_pb2 as apb, context_pb2 as pb
from ctxcache.models.cpu_layout import usable_cores

QUESTION = "In one sentence, what does this license say about distributing modified versions?"


def _ask(client: Client, cid: str, max_tokens: int) -> pb.Final:
    req = pb.GenerateRequest(context_id=cid, question=QUESTION, sampling=pb.SamplingParams(max_tokens=max_tokens))
    return [e for e in client.generate(req, timeout=600)][-1].final


def _throughput(client: Client, cid: str, streams: int, max_tokens: int) -> dict:
    finals, errors = [], []

    def one() -> None:
        try:
            finals.append(_ask(client, cid, max_tokens))
        except Exception as exc:  # noqa: BLE001 - recorded in the result
            errors.append(repr(exc))

    before = client.admin.Stats(apb.StatsRequest())
    wall = run_together([one] * streams)
    after = client.admin.Stats(apb.StatsRequest())
    steps, rows = after.decode_steps - before.decode_steps, after.decode_rows - before.decode_rows
    tokens = sum(f.usage.generated_tokens for f in finals)
    return {"streams": streams, "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "mean_ttft_s": statistics.mean(f.timings.ttft_seconds for f in finals) if finals else None,
            "mean_decode_batch": rows / steps if steps else 0.0, "errors": errors}


def _server_flags(args, data: Path) -> list[str]:
    flags = ["--model", args.model, "--method", args.method, "--data", str(data), "--store-budget-gb", "8",
             "--max-streams", "32"]
    return flags + (["--threads", str(args.threads)] if args.threads else [])


def _put(client: Client, args, text: str) -> pb.ContextInfo:
    req = pb.PutContextRequest(text=text, wait=True)
    req.method.name = args.method
    req.method.params.update(json.loads(args.params))  # per request, as a user sets them
    info = client.put(req, timeout=3600).context
    if info.state != pb.CONTEXT_STATE_READY:
        raise RuntimeError(f"PutContext failed: {info.error}")
    return info


def run(args) -> dict:
    from ctxcache.models.loader import load_model

    lm = load_model(args.model)  # the bench's own copy: the text's tokens and the re-prefill baseline
    text = text_of_tokens(lm.tokenizer, builtin_text("prose"), args.tokens)
    with tempfile.TemporaryDirectory(prefix="ctxcache-bench-") as tmp, \
            running_server(_server_flags(args, Path(tmp) / "data"), Path(tmp) / "serve.log") as address:
        client = Client(address)
        try:
            return _measure(client, lm, args, text)
        finally:
            client.close()


def _measure(client: Client, lm, args, text: str) -> dict:
    out: dict = {"method": args.method, "method_params": json.loads(args.params)}
    t0 = time.perf_counter()
    info = _put(client, args, text)
    out.update(model=info.model_id, build_s=time.perf_counter() - t0, context_tokens=info.n_tokens,
               artifact_bytes=info.artifact_bytes, raw_kv_bytes=info.raw_kv_bytes,
               artifact_over_raw_kv=info.artifact_bytes / info.raw_kv_bytes)
    cold = _ask(client, info.context_id, 1)
    out.update(cold_ttft_s=cold.timings.ttft_seconds, load_s=cold.timings.load_seconds,
               question_tokens=cold.usage.new_prompt_tokens)
    warm = [_ask(client, info.context_id, 1).timings.ttft_seconds for _ in range(args.repeats)]
    out.update(cached_ttft_s=statistics.median(warm), cached_ttft_all_s=warm)
    out["reprefill_ttft_s"] = reprefill_seconds(lm, cold.usage.cached_tokens + cold.usage.new_prompt_tokens)
    parts = client.admin.Describe(apb.DescribeRequest(context_id=info.context_id)).stored_bytes_by_part
    out["stored_bytes_by_part"] = dict(parts)
    out["throughput"] = [_throughput(client, info.context_id, n, args.max_tokens) for n in (1, 4, 16)]
    out["stats"] = str(client.admin.Stats(apb.StatsRequest())).replace("\n", "; ")
    llama = _llama_cpp(args, info.n_tokens)
    out["llama_cpp"] = {"tokens_per_s": llama.tokens_per_s, "via": llama.via}
    return out


def _llama_cpp(args, context_tokens: int) -> LlamaCpp:
    """llama.cpp on the same GGUF at the same context, one stream (the bundled model only)."""
    if args.model != "smollm2":
        return LlamaCpp(None, f"only for the bundled smollm2 GGUF, not {args.model}")
    return measure_llama_cpp(bundled_gguf(), context_tokens, args.max_tokens, args.threads or usable_cores())


# llama.cpp's decode speed on the bundled SmolLM2 GGUF, beside ctxcache's: through
# llama-cpp-python where it is installed, else a `llama-bench` binary on PATH (or at
# $LLAMA_BENCH); where neither is, a line saying so (no number). One stream, greedy, after a
# context of `depth` tokens: what this bench measures for ctxcache on one stream.


@dataclass(frozen=True)
class LlamaCpp:
    tokens_per_s: float | None
    via: str  # "llama-cpp-python", "llama-bench", or why there is no number

    def line(self) -> str:
        if self.tokens_per_s is None:
            return f"llama.cpp: not measured ({self.via})"
        return f"{self.tokens_per_s:.1f} tok/s ({self.via})"


def bundled_gguf() -> Path:
    from ctxcache.models.loader import _GGUF_NAME, _bundled_smollm2_dir
    return _bundled_smollm2_dir() / _GGUF_NAME


def measure_llama_cpp(gguf: Path, depth: int, new_tokens: int, threads: int) -> LlamaCpp:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        binary = os.environ.get("LLAMA_BENCH") or shutil.which("llama-bench")
        if binary is None:
            return LlamaCpp(None, "neither llama-cpp-python nor a llama-bench binary is installed: "
                                  "pip install llama-cpp-python, or put llama-bench on PATH")
        return _llama_bench(binary, gguf, depth, new_tokens, threads)
    return _python(gguf, depth, new_tokens, threads)


def _python(gguf: Path, depth: int, new_tokens: int, threads: int) -> LlamaCpp:
    from llama_cpp import Llama
    llm = Llama(model_path=str(gguf), n_ctx=depth + new_tokens + 8, n_threads=threads, verbose=False)
    context = (llm.tokenize(b"The quick brown fox jumps over the lazy dog. ") * (depth // 8 + 1))[:depth]
    llm.eval(context)
    token = llm.sample(temp=0.0)
    t0 = time.perf_counter()
    for _ in range(new_tokens):
        llm.eval([token])
        token = llm.sample(temp=0.0)
    return LlamaCpp(new_tokens / (time.perf_counter() - t0), "llama-cpp-python")


def _llama_bench(binary: str, gguf: Path, depth: int, new_tokens: int, threads: int) -> LlamaCpp:
    cmd = [binary, "-m", str(gguf), "-p", "0", "-n", str(new_tokens), "-d", str(depth), "-t", str(threads),
           "-r", "3", "-o", "json"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True)
        runs = [r for r in json.loads(done.stdout) if r.get("n_gen", 0) > 0]
        return LlamaCpp(float(runs[0]["avg_ts"]), f"llama-bench, depth {depth}")
    except (OSError, subprocess.SubprocessError, ValueError, LookupError) as exc:
        return LlamaCpp(None, f"{binary} failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")


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
    llama = r["llama_cpp"]
    rows.append(("llama.cpp, 1 stream, same GGUF and context", LlamaCpp(llama["tokens_per_s"], llama["via"]).line()))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"| {k:<{width}} | {v} |" for k, v in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ctxcache bench service", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_out(ap)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--method", default="csattention")
    ap.add_argument("--params", default="{}", help='JSON method parameters, e.g. {"table_dtype": "float16"}')
    ap.add_argument("--tokens", type=int, default=4000, help="context length in tokens")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens per stream in the throughput runs")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads of this process and the server (0: torch's default, one per core)")
    args = ap.parse_args(argv)
    try:
        if not isinstance(json.loads(args.params), dict):
            raise ValueError("not an object")
    except ValueError as exc:
        ap.error(f"--params {args.params!r} must be a JSON object: {exc}")
    if args.threads:
        torch.set_num_threads(args.threads)
    result = {"args": vars(args), **run(args)}
    print(table(result))
    print(f"wrote {write_result('service', result, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
