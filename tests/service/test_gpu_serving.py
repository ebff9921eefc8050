"""On a GPU, through a real server: every kernel is compiled before SERVING (none while streams
of 1 to 8 rows decode, in HBM slots or offloaded), and a context of over 120K tokens decodes with the defaults at
Llama-3.1-8B shapes (the re-rank's score kernel aborted the server there: LLVM could not compile
it when Triton knew its candidate count divisible by 16)."""

import gc
import itertools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import grpc
import pytest
import torch
import triton
import triton.language as tl

from ctxcache.client import Client
from ctxcache.client.gen.v1 import admin_pb2 as apb, context_pb2 as pb
from ctxcache.models.loader import load_model
from ctxcache.service.server import create_server
from service_helpers import tiny_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(autouse=True)
def _free_the_gpu():
    """A stopped server is garbage in reference cycles (its loop, servicers, threads): collect
    it, or the next test's 8B model and slots do not fit beside it (OOM on an 80 GB H100)."""
    yield
    _collect()


@triton.jit
def _probe_kernel(x_ptr, VALUE: tl.constexpr):
    tl.store(x_ptr, VALUE)


_PROBES = itertools.count(1)


def _compile_a_new_kernel() -> None:
    """A kernel specialization new to the process (a constexpr value never used before)."""
    _probe_kernel[(1,)](torch.zeros(1, dtype=torch.int32, device="cuda"), VALUE=next(_PROBES))


def _collect() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def _generate(client: Client, cid: str, tokens: int) -> pb.Final:
    req = pb.GenerateRequest(context_id=cid, question="who is the keeper?", sampling=pb.SamplingParams(max_tokens=tokens))
    return list(client.generate(req, timeout=600))[-1].final


@pytest.mark.parametrize("mode", ["sparse", "dense", "offload", "offload-k-host", "offload-graphs"])
def test_no_kernel_compiles_after_serving(tmp_path, mode):
    """offload: one GPU slot of 128 tokens, so every context (about 160-570 tokens: past the GPU
    slot, inside the 768 of a host slot) decodes from the host slots, 1 to 8 streams in one
    batched step (8 host slots), K in HBM (or, offload-k-host, read from the host); admin Stats
    then counts their steps' PCIe bytes. offload-graphs: the questions' prefills padded and
    replayed as CUDA graphs (--offload-prefill-graphs), which the warm-up's check left on."""
    cfg = tiny_config(tmp_path)
    offload = mode.startswith("offload")
    cfg = replace(cfg, indexer=replace(cfg.indexer, method="csattention"),
                  decoder=replace(cfg.decoder, gpu_slots=1 if offload else 8, gpu_slot_tokens=128 if offload else 1024,
                                  decode_mode="sparse" if offload else mode, offload=offload, offload_slots=8,
                                  offload_k="host" if mode == "offload-k-host" else "hbm",
                                  offload_prefill_graphs=mode == "offload-graphs"))
    server, port = create_server(cfg, load_model("random:tiny", device="cuda"))
    client = Client(f"127.0.0.1:{port}")
    try:
        # contexts of several lengths (divisible by 16 or not), every one past an offload's GPU slot
        cids = [client.put(pb.PutContextRequest(text=f"the keeper is K{i}. " * (8 + 3 * i),
                                                wait=True), timeout=300).context.context_id for i in range(8)]
        for streams in range(1, 9):
            with ThreadPoolExecutor(streams) as pool:
                finals = list(pool.map(lambda c: _generate(client, c, 6), cids[:streams]))
            assert all(f.decode_path == ("gpu-offload" if offload else f"gpu-{mode}") for f in finals)
        assert server.compiles.after_ready() == 0, server.compiles.names
        _compile_a_new_kernel()  # the counter counted all along (one that never counts would pass above);
        assert server.compiles.after_ready() == 1  # not `warm-up compiled > 0`: an earlier test may have built all
        if mode == "offload-graphs":
            (off,) = [e.runner for e in server.decoder.engines if e.runner.name == "gpu-offload"]
            assert off.prefill_graphs is not None and not off.prefill_graphs.broken
        stats = client.admin.Stats(apb.StatsRequest())
        assert (stats.offload_steps > 0 and stats.offload_pcie_bytes > 0) == offload
    finally:
        client.close()
        server.stop(0)


def test_generate_past_120k_tokens_with_the_defaults(tmp_path):
    n_ctx = 121_000
    cfg = tiny_config(tmp_path)
    cfg = replace(cfg, model=replace(cfg.model, model="random:llama-3.1-8b", dtype="bfloat16", device="cuda"),
                  store=replace(cfg.store, budget_bytes=64 << 30),
                  indexer=replace(cfg.indexer, method="csattention"),
                  decoder=replace(cfg.decoder, gpu_slots=1, gpu_slot_tokens=n_ctx + 2048, dram_cache_bytes=32 << 30))
    server, port = create_server(cfg, load_model("random:llama-3.1-8b", torch.bfloat16, "cuda"))
    client = Client(f"127.0.0.1:{port}")
    try:
        info = client.put(pb.PutContextRequest(text=_text_of(server.lm.tokenizer, n_ctx), wait=True),
                          timeout=600).context
        assert info.state == pb.CONTEXT_STATE_READY, info.error
        assert info.n_tokens >= 120_000
        final = _generate(client, info.context_id, 16)
        assert final.decode_path == "gpu-sparse"
        assert final.usage.generated_tokens == 16
    finally:
        client.close()
        server.stop(0)


def _text_of(tokenizer, n_tokens: int) -> str:
    """Distinct sentences cut to n_tokens tokens (one byte a token without a tokenizer)."""
    text = "".join(f"Record {i} keeps the value {i * 7919 % 100003}. " for i in range(n_tokens))
    if tokenizer is None:
        return text[:n_tokens]
    return tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)[:n_tokens])


def _llama3_server(tmp_path, offload: bool):
    cfg = tiny_config(tmp_path)
    cfg = replace(cfg, model=replace(cfg.model, model="random:llama-3.1-8b", dtype="bfloat16", device="cuda"),
                  indexer=replace(cfg.indexer, method="csattention"),
                  decoder=replace(cfg.decoder, gpu_slots=1, gpu_slot_tokens=1024, offload=offload,
                                  offload_slot_tokens=4096))  # the model's length would pin 4 x 16 GiB
    server, port = create_server(cfg, load_model("random:llama-3.1-8b", torch.bfloat16, "cuda"))
    return server, Client(f"127.0.0.1:{port}")


def test_llama3_context_past_a_slot_is_offloaded_or_refused(tmp_path):
    """Random Llama-3.1-8B (llama3 rope scaling, which the reference path once refused after a
    store round trip): a 3K context on 1K slots decodes offloaded with --offload, and without it
    PutContext refuses it naming --gpu-slot-tokens."""
    server, client = _llama3_server(tmp_path / "offload", offload=True)
    try:
        text = _text_of(server.lm.tokenizer, 3000)
        info = client.put(pb.PutContextRequest(text=text, wait=True), timeout=300).context
        assert info.state == pb.CONTEXT_STATE_READY, info.error
        final = _generate(client, info.context_id, 8)
        assert final.decode_path == "gpu-offload" and final.usage.generated_tokens == 8
    finally:
        client.close()
        server.stop(0)
    del server, client
    _collect()
    server, client = _llama3_server(tmp_path / "slots", offload=False)
    try:
        with pytest.raises(grpc.RpcError) as err:
            client.put(pb.PutContextRequest(text=text, wait=True), timeout=300)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "--gpu-slot-tokens" in err.value.details()
    finally:
        client.close()
        server.stop(0)
