"""A Generate on a context resident in a GPU slot starts from the slot's head: the DRAM tier
(and the store behind it) is not read, the tokens are the same, and when the slot went to
another context meanwhile the stream loads the artifact as any other (a dense GpuRunner on the
CPU, its kernels interpreted; a tiny model and context)."""

import time

import pytest
import torch

from ctxcache.decoder import SparseConfig
from ctxcache.decoder.gpu.runner import GpuRunner
from ctxcache.decoder.runner import ReferenceRunner
from ctxcache.generation import SamplingParams
from ctxcache.indexer import IndexerConfig, build_artifact
from ctxcache.methods import make_method
from ctxcache.models.loader import load_model
from ctxcache.decoder.artifact_cache import ArtifactCache, Loaded
from ctxcache.decoder.cached_context import CachedContext
from ctxcache.decoder.generate_streams import GenerateStreams
from ctxcache.decoder.stream_spec import Final, GenerateSpec
from ctxcache.metrics import Metrics
from ctxcache.prompting import ByteTokenizer, Prompter

SCHEDULE = "0.05-step-1"
pytestmark = pytest.mark.usefixtures("small_score_pad")  # kernels/conftest.py: why
SPEC = GenerateSpec("c", (), SamplingParams(max_tokens=2), prompt_tokens=(5, 6, 7))


@pytest.fixture(scope="module")
def lm():
    return load_model("random:tiny", seed=5, device="cuda" if torch.cuda.is_available() else "cpu")


def _generate(streams: GenerateStreams) -> tuple[list[int], Final]:
    events = list(streams.stream(SPEC, lambda: True, None, time.perf_counter()))
    return [t for e in events[:-1] for t in e.token_ids], events[-1]


def test_a_resident_context_skips_the_dram_tier(lm):
    ctx = torch.randint(0, lm.args.vocab_size, (96,), generator=torch.Generator().manual_seed(1))
    art = build_artifact(lm, ctx, make_method("key-kmeans"), IndexerConfig(kv_dtype="float32", progress=False))
    loads: list[str] = []

    def load(cid: str) -> CachedContext:
        loads.append(cid)
        return CachedContext(art, ("user",), 1)
    cache = ArtifactCache[CachedContext](1 << 30, load, CachedContext.nbytes)
    runner = GpuRunner(lm, None, SparseConfig.from_schedule(SCHEDULE), slots=1, max_len=256, max_new=32)
    streams = GenerateStreams(lm, Prompter(ByteTokenizer()), cache, 4, SCHEDULE, Metrics(),
                              [runner, ReferenceRunner(lm)], decode_mode="dense")
    try:
        first, final = _generate(streams)
        assert loads == ["c"] and final.decode_path == "gpu-dense" and len(first) == 2
        cache.evict("c")  # out of DRAM, still in its slot
        again, final = _generate(streams)
        assert again == first and loads == ["c"] and final.cache_hit
        stale = runner.resident_head("c")
        streams.evict_device("c")  # the slot forgets it: a stream holding the head must reload
        streams._resident = lambda cid: Loaded(CachedContext(stale, ("user",), 0), True, 0.0)
        third, _ = _generate(streams)
        assert third == first and loads == ["c", "c"] and runner.loads == 2
    finally:
        streams.close()


def test_an_offloaded_context_held_in_a_host_slot_skips_the_dram_tier(lm):
    """The offload runner's held contexts start from their head too: a bench round of 8 streams
    on 8 offloaded 32K contexts reloaded the 5 that an 8 GB DRAM tier could not hold (issue 47)."""
    from ctxcache.decoder.gpu.offload_runner import OffloadRunner
    method = make_method("csattention", {"subspaces": 4, "centroids": 16})
    ctx = torch.randint(0, lm.args.vocab_size, (96,), generator=torch.Generator().manual_seed(2))
    art = build_artifact(lm, ctx, method, IndexerConfig(kv_dtype="float32", progress=False))
    loads: list[str] = []

    def load(cid: str) -> CachedContext:
        loads.append(cid)
        return CachedContext(art, ("user",), 1)
    cache = ArtifactCache[CachedContext](1 << 30, load, CachedContext.nbytes)
    runner = OffloadRunner(lm, method.params, SparseConfig.from_schedule(SCHEDULE), slots=1, max_len=256, max_new=32)
    streams = GenerateStreams(lm, Prompter(ByteTokenizer()), cache, 4, SCHEDULE, Metrics(),
                              [runner, ReferenceRunner(lm)], decode_mode="sparse")
    try:
        first, final = _generate(streams)
        assert loads == ["c"] and final.decode_path == "gpu-offload" and len(first) == 2
        cache.evict("c")  # out of DRAM, still in its host slot
        again, final = _generate(streams)
        assert again == first and loads == ["c"] and final.cache_hit and runner.loads == 1
        streams.evict_device("c")  # the host slot forgets it: the next stream loads through DRAM
        third, _ = _generate(streams)
        assert third == first and loads == ["c", "c"] and runner.loads == 2
    finally:
        streams.close()
