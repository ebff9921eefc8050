"""llama.cpp's decode speed on the bundled SmolLM2 GGUF, beside ctxcache's in `bench service`.

Through `llama-cpp-python` where it is installed, else a `llama-bench` binary on PATH (or at
$LLAMA_BENCH); where neither is, a line saying so (no number). One stream, greedy, after a
context of `depth` tokens: what `bench service` measures for ctxcache on one stream.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


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


def measure(gguf: Path, depth: int, new_tokens: int, threads: int) -> LlamaCpp:
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
