"""Admission by capacity (serve --offload): a context that fits an HBM slot is served from a host
slot when every HBM slot is busy, instead of waiting; a context held in a host slot is promoted
to HBM by its next stream once an HBM slot is free and it was used more lately. The runners are
the reference path behind slots of the GPU runners' kind (CPU, a tiny random model)."""

import time
from types import SimpleNamespace

import pytest
import torch

from ctxcache.decoder.artifact_cache import ArtifactCache
from ctxcache.decoder.cached_context import CachedContext
from ctxcache.decoder.generate_streams import GenerateStreams
from ctxcache.decoder.runner import ReferenceRunner
from ctxcache.decoder.scheduler import Placement
from ctxcache.decoder.stream_spec import Final, GenerateSpec
from ctxcache.generation import SamplingParams
from ctxcache.indexer import IndexerConfig, build_artifact
from ctxcache.methods import make_method
from ctxcache.metrics import Metrics
from ctxcache.models.loader import load_model
from ctxcache.prompting import ByteTokenizer, Prompter

SCHEDULE = "0.05-step-1"


class SlotRunner(ReferenceRunner):
    """Slots as GpuRunner and OffloadRunner keep them (a stream holds one; its context stays after;
    its own idle slot, else an empty one, else the least recently used idle one is taken), the
    reference decode behind them. A claim with every slot busy fails: nothing here waits."""

    def __init__(self, lm, slots: int, name: str) -> None:
        super().__init__(lm)
        self.name = name
        self.slots = [SimpleNamespace(context_id=None, busy=False, last_used=0.0) for _ in range(slots)]
        self.admitted: list[str] = []
        self._slot_of: dict[int, SimpleNamespace] = {}
        self.cache, self.max_len, self.max_new = SimpleNamespace(max_len=4096), 4096, 512
        if name != "gpu-offload":
            self.serves = lambda art, config, new_tokens: True  # what marks the fast runner

    def admit(self, context_id, art, prompt, config, max_new, check=lambda: None):
        idle = [s for s in self.slots if not s.busy]
        slot = (next((s for s in idle if s.context_id == context_id), None)
                or next((s for s in idle if s.context_id is None), None)
                or min(idle, key=lambda s: s.last_used, default=None))
        assert slot is not None, f"{self.name}: a stream on {context_id} would wait for a slot"
        slot.busy, slot.context_id = True, context_id
        row, first = super().admit(context_id, art, prompt, config, max_new, check)
        self._slot_of[id(row)] = slot
        self.admitted.append(context_id)
        return row, first

    def release(self, row) -> None:
        slot = self._slot_of.pop(id(row))
        slot.busy, slot.last_used = False, time.monotonic()

    def evict(self, context_id: str) -> bool:
        held = [s for s in self.slots if s.context_id == context_id and not s.busy]
        for s in held:
            s.context_id = None
        return bool(held)


@pytest.fixture(scope="module")
def lm():
    return load_model("random:tiny", seed=5)


def _streams(lm):
    arts = {cid: build_artifact(lm, torch.randint(0, lm.args.vocab_size, (n,), generator=torch.Generator().manual_seed(n)),
                                make_method("key-kmeans"), IndexerConfig(kv_dtype="float32", progress=False))
            for cid, n in (("a", 90), ("b", 70))}
    cache = ArtifactCache[CachedContext](1 << 30, lambda cid: CachedContext(arts[cid], ("user",), 1), CachedContext.nbytes)
    fast, off = SlotRunner(lm, 1, "gpu-dense"), SlotRunner(lm, 1, "gpu-offload")
    streams = GenerateStreams(lm, Prompter(ByteTokenizer()), cache, 8, SCHEDULE, Metrics(),
                              [fast, off, ReferenceRunner(lm)], decode_mode="dense")
    return streams, fast, off


def _open(streams, cid: str, max_tokens: int = 1000):
    """A stream started and its first token read: it holds its slot until closed."""
    spec = GenerateSpec(cid, (), SamplingParams(max_tokens=max_tokens), prompt_tokens=(5, 6, 7))
    events = streams.stream(spec, lambda: True, None, time.perf_counter())
    next(events)
    return events


def _settled(streams, busy: int) -> None:
    """Wait for the engines to release the rows of the streams that ended (their thread does)."""
    end = time.monotonic() + 10
    while sum(s.busy for e in streams.engines[:2] for s in e.runner.slots) != busy:
        assert time.monotonic() < end, "a row was not released"
        time.sleep(0.005)


def _run(streams, cid: str, busy: int) -> Final:
    """A whole stream; `busy`: the slots still held by open streams after it."""
    final = list(_open(streams, cid, max_tokens=3))[-1]
    _settled(streams, busy)
    return final


def test_a_context_is_served_offloaded_while_every_hbm_slot_streams_then_promoted(lm):
    streams, fast, off = _streams(lm)
    streams.placement = Placement(clock=lambda: 0.0)  # uses counted, not decayed
    busy = 1
    try:
        a = _open(streams, "a")  # a holds the one HBM slot
        assert fast.admitted == ["a"] and streams.held_contexts() == (1, 0)
        final = _run(streams, "b", busy)  # not waiting for a's slot: a host slot
        assert final.decode_path == "gpu-offload" and off.admitted == ["b"]
        assert streams.held_contexts() == (1, 1)
        a.close()  # a's stream ends: its slot is idle, a still in it
        _settled(streams, busy := 0)
        assert _run(streams, "b", busy).decode_path == "gpu-dense"  # b used twice, a once: promoted
        assert fast.admitted == ["a", "b"] and off.admitted == ["b"] and streams.promotions == 1
        assert streams.held_contexts() == (1, 0)  # b in HBM alone (a demoted to the DRAM tier)
        a, busy = _open(streams, "a"), 1  # cold, b's slot idle: into HBM (b demoted)
        assert _run(streams, "b", busy).decode_path == "gpu-offload"  # every HBM slot streams again
        a.close()
        _settled(streams, busy := 0)
        _run(streams, "a", busy), _run(streams, "a", busy)  # a: 4 uses, b: 3
        assert _run(streams, "b", busy).decode_path == "gpu-offload"  # 4 against 4: b stays in its host slot
        assert _run(streams, "b", busy).decode_path == "gpu-dense"  # 5 against 4: promoted
        assert fast.admitted == ["a", "b", "a", "a", "a", "b"] and off.admitted == ["b", "b", "b"]
        assert streams.promotions == 2 and streams.held_contexts() == (1, 0)
        assert streams.metrics.registry.get_sample_value("ctxcache_offload_promotions_total") == 2
    finally:
        streams.close()
