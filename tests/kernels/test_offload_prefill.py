"""An offloaded row's question prefill with its host V (K too without K in HBM) copied a layer
ahead on a copy lane (offload_prefill.PrefillFetch) gives the logits, follow state and index
overlay of the serial copy, bit for bit. On a CPU the copy stream is simulated by a lane whose
copies land as late as allowed (a compute read that does not wait for its layer sees NaN) or as
early as allowed (a copy queued before its buffer's last read overwrites it)."""

from dataclasses import replace
from functools import lru_cache

import pytest
import torch

from ctxcache.decoder.gpu.offload_prefill import InlineLane, Pairs, PrefillFetch
from ctxcache.decoder.gpu.offload_runner import OffloadRunner
from ctxcache.decoder.reference_attention import SparseConfig
from ctxcache.indexer import IndexerConfig, build_artifact
from ctxcache.methods import Budget, make_method
from ctxcache.models import config as model_config
from ctxcache.models.loader import load_model

CONFIG = SparseConfig(Budget(0.1, 2, 8))
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPT = list(range(20, 34))
N_CTX = 150


class DeferredLane:
    """Copies run in queue order (one stream): `eager` as soon as the marker each waits for is
    recorded, else only when the compute waits for them. Buffers start as NaN."""

    def __init__(self, eager: bool) -> None:
        self.eager = eager
        self.queue: list[tuple[int | None, Pairs, int]] = []  # (after, pairs, landed)
        self.marks: set[int] = set()
        self.landed: set[int] = set()
        self.n = 0

    def start(self, buffers: list[torch.Tensor]) -> None:
        for b in buffers:  # int8 codes cannot be NaN: their scales are, so a decoded early read is
            b.fill_(float("nan") if b.is_floating_point() else 0)

    def copy(self, pairs: Pairs, after: int | None) -> int:
        self.n += 1
        self.queue.append((after, pairs, self.n))
        self._drain()
        return self.n

    def mark(self) -> int:
        self.n += 1
        self.marks.add(self.n)
        self._drain()
        return self.n

    def wait(self, landed: int) -> None:
        while landed not in self.landed:
            self._run_head()

    def _run_head(self) -> None:
        after, pairs, landed = self.queue.pop(0)
        assert after is None or after in self.marks, "a copy ran before the compute freed its buffer"
        for dst, src in pairs:
            dst.copy_(src)
        self.landed.add(landed)

    def _drain(self) -> None:
        while self.eager and self.queue and (self.queue[0][0] is None or self.queue[0][0] in self.marks):
            self._run_head()


LANES = {"inline": InlineLane, "late": lambda: DeferredLane(False), "early": lambda: DeferredLane(True)}


@pytest.mark.parametrize("lane", sorted(LANES))
def test_fetch_gives_each_layer_its_context_then_its_prompt(lane):
    """Six layers through two buffers, read in order: each layer's parts are its host context's
    positions followed by the prompt keys its layer wrote, whenever the copies land."""
    gen = torch.Generator().manual_seed(0)
    layers, hkv, max_len, d, n_ctx, t = 6, 2, 40, 8, 25, 5
    host = [[torch.randn(1, hkv, max_len, d, generator=gen) for _ in range(2)] for _ in range(layers)]
    prompts = [[torch.randn(1, hkv, t, d, generator=gen) for _ in range(2)] for _ in range(layers)]
    fetch = PrefillFetch(host, n_ctx, n_ctx + t, LANES[lane](), torch.device("cpu"))
    for layer in range(layers):
        fetch.write_prompt(layer, prompts[layer][1], prompts[layer][0])  # (k, v): parts are V, then K
        got = fetch.get(layer)
        for part in range(2):
            want = torch.cat([host[layer][part][:, :, :n_ctx], prompts[layer][part]], 2)
            assert torch.equal(got[part], want), (layer, part)
        fetch.done(layer)
    assert fetch.fetched == layers and fetch.h2d_bytes(layers) == layers * 2 * hkv * n_ctx * d * 4


@pytest.fixture
def four_layers(monkeypatch):
    monkeypatch.setitem(model_config.NAMED_CONFIGS, "tiny4", replace(model_config.NAMED_CONFIGS["tiny"], n_layers=4))
    return "random:tiny4"


@lru_cache(maxsize=None)
def _setup(model: str, coded: bool = False):
    lm = load_model(model, seed=3, device=DEVICE)
    method = make_method("csattention", {"subspaces": 4, "centroids": 16, "rerank": 2.0})  # follow on
    art = build_artifact(load_model(model, seed=3), torch.randint(0, lm.args.vocab_size, (N_CTX,),
                         generator=torch.Generator().manual_seed(N_CTX)), method,
                         IndexerConfig(kv_dtype="float32", progress=False, coded_kv=coded))
    return lm, method, art


MODES = {"k-hbm": {}, "k-host": {"k_hbm": False}, "v-int8": {"v_int8": True}}  # v-int8: V as codes (offload_v)


def _hot_prefill(model: str, mode: str, lane: str | None) -> tuple[OffloadRunner, dict[str, torch.Tensor]]:
    """A context loaded, its stream released, then a question on it a layer a chunk (the hot
    case); lane None: the serial copy. -> the runner and what the prefill left."""
    lm, method, art = _setup(model, mode == "v-int8")
    runner = OffloadRunner(lm, method.params, CONFIG, slots=1, max_len=320, max_new=32, prefill_layers=1,
                           pipelined_prefill=lane is not None, **MODES[mode])
    if lane is not None:
        runner.prefill_lane = LANES[lane]
    runner.release(runner.admit("c", art, [5, 6], CONFIG, 4)[0])
    runner.pcie.prefill = 0
    _, chunks = runner.begin("c", art, PROMPT, CONFIG, 4)
    first = [out for out in chunks][-1]
    t = runner.tables
    # the V the question wrote: the host slot's positions, or (v-int8) the HBM tail's from 0
    written = slice(0, len(PROMPT)) if mode == "v-int8" else slice(0, N_CTX + len(PROMPT))
    return runner, {"logits": first, "follow": torch.stack([x.follow_prev[0] for x in t]),
                    "overlay": torch.stack([x.new_scores[0] for x in t]),
                    "v": torch.stack([v[0, :, written] for v in runner.pool.v])}


_serial = lru_cache(maxsize=None)(lambda model, mode: _hot_prefill(model, mode, None)[1])


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("lane", sorted(LANES))
def test_a_pipelined_hot_prefill_gives_the_serial_copys_logits_and_state(four_layers, mode, lane):
    """The question's first logits, the follow state its last query seeded, its keys' index
    overlay and the host V it wrote equal the serial copy's bit for bit; only the context's
    positions crossed (the prompt's keys stay on the device): pcie.prefill counts them (v-int8:
    codes, and on the CPU a 2-byte scale a row)."""
    runner, got = _hot_prefill(four_layers, mode, lane)
    want = _serial(four_layers, mode)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    a = runner.lm.args
    # v-int8: the codes; the 2-byte scales too where no tensor is on a device (the CPU): on a GPU
    # they are in HBM, copied device to device (PrefillFetch.h2d_bytes)
    row = {"k-hbm": a.head_dim * 4, "k-host": 2 * a.head_dim * 4, "v-int8": a.head_dim + 2 * (DEVICE == "cpu")}[mode]
    assert runner.pcie.prefill == a.n_layers * N_CTX * a.n_kv_heads * row


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: streams and the bf16 kernels")
@pytest.mark.parametrize("v_int8", [False, True])
def test_on_a_gpu_the_copies_run_on_their_own_stream_and_the_logits_are_the_serial_ones(v_int8):
    """A bf16 model of SmolLM2's shapes: the pipelined hot prefill's logits equal the serial
    one's, and its host -> device copies ran on a stream other than the compute kernels'
    (v_int8: V's codes and scales copied, decoded on the compute stream; serially the dequant
    kernel reads them zero-copy: no copy of V at all)."""
    from torch.profiler import ProfilerActivity, profile
    lm = load_model("random:smollm2-135m", seed=3, dtype=torch.bfloat16, device="cuda")
    method = make_method("csattention", {"subspaces": 4, "centroids": 16})
    art = build_artifact(lm, torch.randint(0, lm.args.vocab_size, (2000,), generator=torch.Generator().manual_seed(1)),
                         method, IndexerConfig(kv_dtype="bfloat16", progress=False, coded_kv=v_int8))
    firsts = []
    for pipelined in (False, True):
        runner = OffloadRunner(lm, method.params, CONFIG, slots=1, max_len=2048 + 64, pipelined_prefill=pipelined,
                               v_int8=v_int8)
        runner.release(runner.admit("c", art, PROMPT, CONFIG, 4)[0])
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            row, first = runner.admit("c", art, PROMPT, CONFIG, 4)
            torch.cuda.synchronize()
        firsts.append(first)
        events = prof.profiler.kineto_results.events()
        copies = {e.device_resource_id() for e in events if "HtoD" in e.name()}
        kernels = {e.device_resource_id() for e in events if e.device_type().name == "CUDA" and "Memcpy" not in e.name()
                   and "Memset" not in e.name()}
        # the question's tokens cross on the compute stream either way
        assert copies and (copies - kernels if pipelined else copies <= kernels), (copies, kernels)
    assert torch.equal(firsts[0], firsts[1])
