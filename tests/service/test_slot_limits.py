"""A context larger than the GPU slots never decodes silently on the reference path: PutContext
refuses it naming --gpu-slot-tokens (or --offload, --offload-slot-tokens), and Generate of one built elsewhere answers
FAILED_PRECONDITION; what fits has its answer bounded by the slot. The fast runner here is a
real GpuRunner on the CPU (constructed, not stepped)."""

from types import SimpleNamespace

import grpc
import pytest

from ctxcache.client.gen.v1 import context_pb2 as pb
from ctxcache.decoder import SparseConfig
from ctxcache.decoder.gpu.runner import GpuRunner
from ctxcache.indexer import IndexerConfig, build_artifact
from ctxcache.methods import make_method
from ctxcache.errors import FailedPrecondition
from ctxcache.decoder.generate_streams import GenerateStreams
from ctxcache.service.assembly import SLOT_ROOM, cap_to_slots

CONFIG = SparseConfig.from_schedule("0.05-step-1")


def _engines(*runners):
    return [SimpleNamespace(runner=r) for r in runners]


def test_put_refuses_what_the_gpu_slots_cannot_hold(start, tiny_lm):
    server, client = start()
    fast = GpuRunner(tiny_lm, None, CONFIG, slots=1, max_len=SLOT_ROOM + 200)
    cap_to_slots(server.indexer, _engines(fast, SimpleNamespace(name="reference")))
    ok = client.put(pb.PutContextRequest(text="x" * 100, wait=True), timeout=60).context
    assert ok.state == pb.CONTEXT_STATE_READY
    with pytest.raises(grpc.RpcError) as err:
        client.put(pb.PutContextRequest(text="x" * 400, wait=True), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "--gpu-slot-tokens" in err.value.details() and "--offload" in err.value.details()


def test_put_is_capped_by_the_offload_runners_host_slots(start, tiny_lm):
    """With --offload the larger of the GPU slot and the host slot bounds PutContext."""
    server, _ = start()
    before = server.indexer.max_tokens
    fast = GpuRunner(tiny_lm, None, CONFIG, slots=1, max_len=SLOT_ROOM + 200)
    cap_to_slots(server.indexer, _engines(fast, SimpleNamespace(name="gpu-offload", max_len=before + SLOT_ROOM)))
    assert server.indexer.max_tokens == before
    cap_to_slots(server.indexer, _engines(fast, SimpleNamespace(name="gpu-offload", max_len=SLOT_ROOM + 300)))
    assert server.indexer.max_tokens == 300 and "--offload-slot-tokens" in server.indexer.max_tokens_why


def test_generate_past_the_slot_is_refused_and_answers_are_bounded_by_it(tiny_lm):
    art = build_artifact(tiny_lm, [3 + i % 200 for i in range(300)], make_method("key-kmeans"), IndexerConfig(progress=False))
    streams = SimpleNamespace(engines=_engines(GpuRunner(tiny_lm, None, CONFIG, slots=1, max_len=280, max_new=64),
                                               SimpleNamespace(name="reference")))
    with pytest.raises(FailedPrecondition, match="--gpu-slot-tokens"):
        GenerateStreams._slot_room(streams, art, CONFIG, 10)
    streams.engines[0].runner = GpuRunner(tiny_lm, None, CONFIG, slots=1, max_len=340, max_new=64)
    assert GenerateStreams._slot_room(streams, art, CONFIG, 10) == 340 - 300 - 10
    streams.engines[0].runner = GpuRunner(tiny_lm, None, CONFIG, slots=1, max_len=4096, max_new=64)
    assert GenerateStreams._slot_room(streams, art, CONFIG, 10) == 64 - 10  # the index overlay's room
    # with --offload: the larger room of the GPU slot and the host slot (its own index overlay)
    off = SimpleNamespace(name="gpu-offload", max_len=1024, max_new=512, accepts=lambda a, c, n: 300 + n <= 1024)
    streams.engines.append(SimpleNamespace(runner=off))
    assert GenerateStreams._slot_room(streams, art, CONFIG, 10) == 512 - 10
    off.max_len, off.accepts = 300, lambda a, c, n: False  # no host slot holds it either
    streams.engines[0].runner = GpuRunner(tiny_lm, None, CONFIG, slots=1, max_len=280, max_new=64)
    with pytest.raises(FailedPrecondition, match="--offload-slot-tokens"):
        GenerateStreams._slot_room(streams, art, CONFIG, 10)


def test_offload_settings_are_validated():
    from ctxcache.service.config import DecoderSettings
    with pytest.raises(ValueError, match="offload_slots=0"):
        DecoderSettings(offload_slots=0)
    with pytest.raises(ValueError, match="offload_slot_tokens=-1"):
        DecoderSettings(offload_slot_tokens=-1)
    with pytest.raises(ValueError, match="offload_k='gpu'"):
        DecoderSettings(offload_k="gpu")


def test_offload_prefill_graphs_is_a_serve_flag_on_by_default(tmp_path):
    """serve --[no-]offload-prefill-graphs reaches the decoder's settings (on unless turned off);
    bench serve passes it to its offload servers."""
    from ctxcache.bench.serve import server_flags
    from ctxcache.service.cli import main as cli
    from ctxcache.service.cli.commands import service_config
    serve = ["serve", "--model", "random:tiny", "--port", "0", "--offload"]
    for flags, want in (([], True), (["--offload-prefill-graphs"], True), (["--no-offload-prefill-graphs"], False)):
        args = cli.build_parser().parse_args([*serve, *flags])
        assert service_config(args, 0).decoder.offload_prefill_graphs is want
    bench = SimpleNamespace(hbm_gb=0, offload_k="hbm", offload_v_cache=4.0, offload_prefill_graphs=True, tokens=8,
                            model="random:tiny", device="cpu", dtype="float32", store_gb=1.0, dram_gb=1.0,
                            method_params="{}")
    point = SimpleNamespace(streams={"offload": [1, 2]}, n_ctx=300)
    assert "--offload-prefill-graphs" in server_flags(bench, "offload", point, tmp_path)
    bench.offload_prefill_graphs = False
    assert "--no-offload-prefill-graphs" in server_flags(bench, "offload", point, tmp_path)
