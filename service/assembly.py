"""The parts create_server (server.py) assembles from the config: the decode runners for the
device, PutContext's limit where GPU slots bound it, the store and registry (and the page-locked
host pool the store loads into), and the registry's reconcile at start."""

from __future__ import annotations

import logging
import time

import torch

from ctxcache import host_pool
from ctxcache.decoder import SparseConfig
from ctxcache.decoder.decode_mode import resolve
from ctxcache.decoder.runner import ReferenceRunner, Runner
from ctxcache.methods import make_method
from ctxcache.models.loader import LoadedModel, load_model
from ctxcache.service.backend import Backend
from ctxcache.indexer.build_queue import BuildQueue
from ctxcache.service.config import ServiceConfig
from ctxcache.store import EmbeddedRegistry, ObjectStoreConfig, StoreConfig, open_store

log = logging.getLogger("ctxcache.service")


def decode_runners(lm: LoadedModel, config: ServiceConfig) -> list[Runner]:
    """On a GPU: the fast runner (sparse when the method has a GPU selector, or dense), then the
    reference runner for every other method and schedule; on a CPU: the reference runner."""
    reference = ReferenceRunner(lm)
    if lm.model.lm_head.weight.device.type != "cuda":
        if config.decoder.offload or config.decoder.gpu_memory_bytes:
            log.warning("--offload and --gpu-memory-gb apply to a GPU; on the CPU every context decodes on "
                        "the reference path")
        return [reference]
    from ctxcache.decoder.gpu.capacity import MAX_NEW, slots_within
    from ctxcache.decoder.gpu.runner import GpuRunner  # Triton only where a GPU is
    d, ix = config.decoder, config.indexer
    method = make_method(ix.method, ix.method_params)
    mode = resolve(d.decode_mode, "cuda", 0)  # one fast runner per server: auto's pick for the GPU
    if mode == "sparse" and not method.caps.gpu_decode:
        return [reference]
    params = method.params if mode == "sparse" else None
    slots = d.gpu_slots
    if d.gpu_memory_bytes:
        slots = slots_within(d.gpu_memory_bytes, lm.args, params, d.gpu_slot_tokens, MAX_NEW,
                             lm.model.lm_head.weight.element_size())
    schedule = SparseConfig.from_schedule(d.schedule)
    fast = GpuRunner(lm, params, schedule, slots, d.gpu_slot_tokens)
    torch.cuda.empty_cache()  # what loading left reserved goes back to the driver (cuBLAS, graphs, kernels)
    free = torch.cuda.mem_get_info()[0]
    log.info("GPU runner %s: %d slots of %d tokens (%.2f GiB each); %.1f GiB of HBM left free", fast.name, slots,
             d.gpu_slot_tokens, fast.slot_bytes / 2**30, free / 2**30)
    if d.offload and params is not None:
        from ctxcache.decoder.gpu.offload_runner import OffloadRunner
        # V as int8 codes in the host slots where the server's contexts are int8-coded (K in HBM);
        # contexts of other codecs are then not offloaded (OffloadRunner.refusal)
        v_int8 = ix.kv_codec == "int8" and d.offload_k == "hbm"
        off = OffloadRunner(lm, params, schedule, d.offload_slots, d.offload_slot_tokens, k_hbm=d.offload_k == "hbm",
                            v_cache=d.offload_v_cache, v_int8=v_int8, prefill_graphs=d.offload_prefill_graphs)
        log.info("offload runner: %d host slots of %d tokens (%.1f GiB page-locked, V %s), K in %s (%.1f GiB of HBM), "
                 "V cache %.1f GiB, prefill graphs %s", d.offload_slots, off.max_len, off.pool.nbytes / 2**30,
                 "int8 codes" if v_int8 else "decoded", d.offload_k, sum(k.nbytes for k in off.k or ()) / 2**30,
                 sum(c.nbytes() for c in off.caches) / 2**30, "on" if d.offload_prefill_graphs else "off")
        return [fast, off, reference]  # contexts no slot holds: K/V in host memory
    return [fast, reference]


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def load_configured_model(config: ServiceConfig) -> LoadedModel:
    """The model the config names, on its device (the server's, and its warm-up check child's)."""
    m = config.model
    lm = load_model(m.model, _DTYPES[m.dtype], m.device)
    if lm.model.lm_head.weight.is_cuda:  # a random model's fp32 draft stays reserved otherwise (an
        torch.cuda.empty_cache()  # 8B: 16 GB that an indexer beside a decoder on one GPU needs)
    return lm


# a context must leave its slot room for a question and the start of an answer
SLOT_ROOM = 256


def cap_to_slots(indexer: BuildQueue, engines) -> None:
    """On a GPU server, PutContext refuses what neither its slots nor (with --offload) its host
    slots can decode (naming the flags) instead of building a context that would decode on the
    reference path."""
    runners = [e.runner for e in engines]
    fast = next((r for r in runners if hasattr(r, "serves")), None)
    if fast is None:
        return
    off = next((r for r in runners if r.name == "gpu-offload"), None)
    limit = max(fast.cache.max_len, off.max_len if off is not None else 0) - SLOT_ROOM
    if limit < indexer.max_tokens:
        indexer.max_tokens = max(1, limit)
        indexer.max_tokens_why = (f"GPU slots of {fast.cache.max_len} tokens keep {SLOT_ROOM} for the question "
                                  f"and answer: start the server with a larger --gpu-slot-tokens, or with --offload"
                                  + ("" if off is None else f" and a larger --offload-slot-tokens (now {off.max_len})"))


def open_store_and_registry(config: ServiceConfig):
    budget = config.store.budget_bytes
    pin = config.store.pin_memory
    pin = config.model.device.startswith("cuda") if pin is None else pin
    st = config.store
    if pin:
        pin = install_host_pool(st.host_pool_bytes, config.decoder.dram_cache_bytes)
    store = open_store(st.path, StoreConfig(map_size_bytes=budget + budget // 4 + (64 << 20), budget_bytes=budget,
                                            pin_memory=pin),
                       st.object_store_uri, ObjectStoreConfig(budget_bytes=st.object_budget_bytes))
    if config.fleet.role != "all":  # a fleet's registry of facts (service/roles.py)
        return store, None, "fleet"
    url = config.registry.redis_url
    if url is None:
        return store, EmbeddedRegistry(), "embedded"
    from ctxcache.store import RedisRegistry
    return store, RedisRegistry(config.registry.redis_config()), "redis"


POOL_SLACK = 4 << 30  # beyond the DRAM cache: loads in flight, evicted artifacts streams still read


def install_host_pool(pool_bytes: int | None, dram_cache_bytes: int) -> bool:
    """-> whether loads go to page-locked memory: the pool's (or, with a pool of 0 bytes, a
    mapping locked per load); False when the pool could not be locked (loads run unpinned)."""
    size = dram_cache_bytes + POOL_SLACK if pool_bytes is None else pool_bytes
    if size <= 0:
        return True
    t0 = time.perf_counter()
    if host_pool.install(size) is None:
        return False
    log.info("page-locked host pool: %.1f GiB in %.1f s", size / (1 << 30), time.perf_counter() - t0)
    return True


def reconcile(backend: Backend) -> None:
    try:
        added, removed, damaged = backend.reconcile()
        log.info("reconciled registry: %d added, %d removed, %d damaged", added, removed, len(damaged))
    except Exception as exc:  # noqa: BLE001 - Redis down at start: serve, Reconcile later
        log.warning("registry reconcile at start failed: %s", exc)
