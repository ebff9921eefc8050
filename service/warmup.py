"""Warm-up before SERVING: every kernel compiled and every batch bucket's graph captured while
gRPC health still says NOT_SERVING, so no stream pays a compile and no compiler failure meets a
live server (Triton compiled mid-serving the first time a bucket was used under load)."""

from __future__ import annotations

import logging
import time

import torch

from ctxcache.artifact import KV_CODECS
from ctxcache.decoder.runner import Runner
from ctxcache.indexer import IndexerConfig, build_artifact
from ctxcache.kernels.compiles import CompileCounter
from ctxcache.methods import make_method
from ctxcache.models.loader import LoadedModel
from ctxcache.service.config import ServiceConfig

log = logging.getLogger("ctxcache.service")
# two short contexts, one a multiple of 16 tokens long and one not: a prompt's prefill passes
# the context length to kernels that Triton specializes on divisibility by 16
WARM_LENGTHS = (304, 301)


class WarmUpFailed(RuntimeError):
    """A runner could not compile or run its kernels: the server must not start."""


def warm_up(lm: LoadedModel, runners: list[Runner], method: str, params: dict, kv_dtype: str,
            counter: CompileCounter) -> None:
    """Run every runner that warms up (the GPU ones) on small contexts of the server's method,
    then mark the counter ready; logs one line with the time, compilations and memory."""
    warmable = [r for r in runners if hasattr(r, "warm_up")]
    if not warmable:
        counter.ready()
        return
    t0 = time.perf_counter()
    try:
        gen = torch.Generator().manual_seed(0)
        arts = [build_artifact(lm, torch.randint(3, 200, (n,), generator=gen), make_method(method, params),
                               IndexerConfig(progress=False, kv_dtype=kv_dtype, kv_codec=codec, coded_kv=True))
                for n in WARM_LENGTHS for codec in KV_CODECS]  # each codec decodes its K/V by its own kernels
        for runner in warmable:
            runner.warm_up(arts)
    except Exception as exc:  # noqa: BLE001 - named in one line; the server refuses to start
        raise WarmUpFailed(f"warm-up of the decode runners failed: {type(exc).__name__}: "
                           f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc
    counter.ready()
    used = torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
    log.info("warm-up: %s in %.1f s, %d kernel compilations, %.2f GiB of GPU memory allocated",
             ", ".join(r.name for r in warmable), time.perf_counter() - t0, counter.total, used)


def warm_up_server(lm: LoadedModel, runners: list[Runner], config: ServiceConfig, counter: CompileCounter) -> None:
    """The server's warm-up, in the server and in its warm-up check's child alike (warm_up_check.py):
    its method and the fp16 K/V its builds make."""
    warm_up(lm, runners, config.indexer.method, config.indexer.method_params, "float16", counter)
