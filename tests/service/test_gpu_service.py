"""On a GPU: a real server decodes with the fast runner (csattention) and the reference runner
(every other method), from contexts it built on the GPU; the Final message names the path."""

import time
from dataclasses import replace

import pytest
import torch

from ctxcache.methods import METHODS
from ctxcache.models.loader import load_model
from ctxcache.client import Client
from ctxcache.client.gen.v1 import context_pb2 as pb
from ctxcache.service.server import create_server
from service_helpers import tiny_config

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _serve(cfg, device):
    server, port = create_server(cfg, load_model("random:tiny", device=device))
    return server, Client(f"127.0.0.1:{port}")


def _put(client, text, method, params=None):
    spec = pb.MethodSpec(name=method)
    if params:
        spec.params.update(params)
    info = client.put(pb.PutContextRequest(text=text, wait=True, method=spec), timeout=300).context
    assert info.state == pb.CONTEXT_STATE_READY, info.error
    return info.context_id


@pytest.mark.parametrize("method", sorted(METHODS))
def test_put_and_generate_on_cuda(tmp_path, method):
    """One context built by a CPU server, one by the CUDA server, on the same store: the CUDA
    server decodes both (a one-token question goes through a decode step, not a prefill)."""
    cfg = tiny_config(tmp_path)
    cfg = replace(cfg, indexer=replace(cfg.indexer, method="csattention"),
                  decoder=replace(cfg.decoder, gpu_slots=2, gpu_slot_tokens=2048))
    server, client = _serve(cfg, "cpu")
    try:
        built_on_cpu = _put(client, "the keeper is named Ada. " * 20, method)
    finally:
        client.close()
        server.stop(0)
    server, client = _serve(cfg, "cuda")
    try:
        built_on_gpu = _put(client, "the keeper is named Bo. " * 20, method)
        for cid in (built_on_cpu, built_on_gpu):
            for question in ("who is the keeper?", "?"):
                events = list(client.generate(pb.GenerateRequest(
                    context_id=cid, question=question, sampling=pb.SamplingParams(max_tokens=8)), timeout=300))
                final = events[-1].final
                assert final.usage.generated_tokens >= 1
                assert final.decode_path == ("gpu-sparse" if method == "csattention" else "reference")
    finally:
        client.close()
        server.stop(0)


def test_parameters_other_than_the_runners_decode_on_the_reference_path(tmp_path):
    """The fast runner serves the server's csattention parameters (default: exact re-rank 4);
    a context built with others (rerank 1) decodes on the reference path, correctly."""
    cfg = tiny_config(tmp_path)
    cfg = replace(cfg, indexer=replace(cfg.indexer, method="csattention"),
                  decoder=replace(cfg.decoder, gpu_slots=2, gpu_slot_tokens=2048))
    server, client = _serve(cfg, "cuda")
    try:
        for params, path in (({"rerank": 1.0}, "reference"), (None, "gpu-sparse")):
            cid = _put(client, f"the keeper is named Cy ({path}). " * 16, "csattention", params)
            events = list(client.generate(pb.GenerateRequest(
                context_id=cid, question="who is the keeper?", sampling=pb.SamplingParams(max_tokens=8)), timeout=300))
            assert events[-1].final.decode_path == path
    finally:
        client.close()
        server.stop(0)


@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_the_hbm_budget_decides_the_slots(tmp_path, mode):
    """--gpu-memory-gb: the server holds as many slots as the budget holds in its mode, says so in
    admin Stats, and serves that many contexts resident at once."""
    from ctxcache.client.gen.v1 import admin_pb2 as apb
    from ctxcache.decoder.gpu.capacity import MAX_NEW, slot_bytes
    from ctxcache.methods import make_method

    lm = load_model("random:tiny", device="cuda")
    params = make_method("csattention").params if mode == "sparse" else None
    each = slot_bytes(lm.args, params, 2048, MAX_NEW, lm.model.lm_head.weight.element_size())
    cfg = tiny_config(tmp_path)
    cfg = replace(cfg, indexer=replace(cfg.indexer, method="csattention"),
                  decoder=replace(cfg.decoder, decode_mode=mode, gpu_slot_tokens=2048, gpu_memory_bytes=3 * each + 1))
    server, port = create_server(cfg, lm)
    client = Client(f"127.0.0.1:{port}")
    try:
        stats = client.admin.Stats(apb.StatsRequest())
        assert (stats.device_slots, stats.device_slot_bytes) == (3, each)
        for i in range(3):
            cid = _put(client, f"the keeper is named K{i}. " * 16, "csattention")
            events = list(client.generate(pb.GenerateRequest(
                context_id=cid, question="who?", sampling=pb.SamplingParams(max_tokens=4)), timeout=300))
            assert events[-1].final.decode_path == ("gpu-sparse" if mode == "sparse" else "gpu-dense")
    finally:
        client.close()
        server.stop(0)


def test_a_context_longer_than_a_slot_decodes_offloaded(tmp_path):
    """serve --offload: a context no slot holds decodes with its K/V in host memory, and admin
    Stats counts its GPU cache's hits (tests/kernels/test_offload_runner.py compares tokens)."""
    from ctxcache.client.gen.v1 import admin_pb2 as apb

    cfg = tiny_config(tmp_path)
    cfg = replace(cfg, indexer=replace(cfg.indexer, method="csattention"),
                  decoder=replace(cfg.decoder, gpu_slots=1, gpu_slot_tokens=128, offload=True))
    server, client = _serve(cfg, "cuda")
    try:
        cid = _put(client, "the keeper is named Di and the gate is blue. " * 6, "csattention")
        req = pb.GenerateRequest(context_id=cid, question="who is the keeper?",
                                 sampling=pb.SamplingParams(max_tokens=12))
        final = list(client.generate(req, timeout=300))[-1].final
        assert final.decode_path == "gpu-offload" and final.usage.generated_tokens >= 1
        stats = client.admin.Stats(apb.StatsRequest())
        assert 0 <= stats.offload_cache_hits <= stats.offload_selected_keys and stats.offload_selected_keys > 0
        assert stats.offload_hit_rate == pytest.approx(stats.offload_cache_hits / stats.offload_selected_keys)
        assert (stats.resident_contexts, stats.offloaded_contexts) == (0, 1)
    finally:
        client.close()
        server.stop(0)


def test_with_every_hbm_slot_streaming_a_context_is_served_offloaded_then_promoted(tmp_path):
    """serve --offload, one HBM slot: while a stream holds it, a context that fits it decodes from
    a host slot instead of waiting; used more lately than the slot's context once that stream
    ended, its next stream takes the HBM slot (decoder/scheduler.Placement)."""
    from ctxcache.client.gen.v1 import admin_pb2 as apb

    cfg = tiny_config(tmp_path)
    cfg = replace(cfg, indexer=replace(cfg.indexer, method="csattention"),
                  decoder=replace(cfg.decoder, gpu_slots=1, gpu_slot_tokens=1024, offload=True,
                                  offload_slot_tokens=1024))
    server, client = _serve(cfg, "cuda")

    def ask(cid, max_tokens=4):
        return client.generate(pb.GenerateRequest(context_id=cid, question="who is the keeper?",
                                                  sampling=pb.SamplingParams(max_tokens=max_tokens)), timeout=300)
    try:
        a, b = (_put(client, f"the keeper is named {n} and the gate is blue. " * 6, "csattention") for n in "AB")
        held = ask(a, max_tokens=480)  # still streaming when b asks (a tiny model steps in ~1 ms)
        next(held)  # a streams in the one HBM slot
        assert list(ask(b))[-1].final.decode_path == "gpu-offload"
        stats = client.admin.Stats(apb.StatsRequest())
        assert (stats.resident_contexts, stats.offloaded_contexts) == (1, 1)
        held.cancel()
        for _ in range(200):  # the engine releases a's slot after its next step
            if client.admin.Stats(apb.StatsRequest()).active_streams == 0:
                break
            time.sleep(0.05)
        time.sleep(0.2)
        assert list(ask(b))[-1].final.decode_path == "gpu-sparse"  # b: 2 streams, a: 1
        stats = client.admin.Stats(apb.StatsRequest())
        assert (stats.resident_contexts, stats.offloaded_contexts, stats.offload_promotions) == (1, 0, 1)
    finally:
        client.close()
        server.stop(0)
