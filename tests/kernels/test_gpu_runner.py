"""The fast GPU runner against the reference runner: same artifacts, same engine loop, same
greedy tokens (a random model in fp32; on CPU the Triton kernels run interpreted, without
graphs). Distinct contexts decode together in one static cache; a context stays resident in
its slot for the next stream."""

import pytest
import torch

from ctxcache.decoder.engine import Engine
from ctxcache.decoder.gpu.runner import GpuRunner
from ctxcache.decoder.reference_attention import SparseConfig
from ctxcache.decoder.runner import ReferenceRunner
from ctxcache.generation import SamplingParams
from ctxcache.indexer import IndexerConfig, build_artifact
from ctxcache.methods import Budget, make_method
from ctxcache.models.loader import load_model

CONFIG = SparseConfig(Budget(0.1, 2, 8))
pytestmark = pytest.mark.usefixtures("small_score_pad")  # kernels/conftest.py: why
STEPS = 64 if torch.cuda.is_available() else 4  # 64 greedy tokens where the kernels run compiled


@pytest.fixture(scope="module")
def cpu_lm():
    return load_model("random:tiny", seed=3)


@pytest.fixture(scope="module")
def lm():
    """The decoding model, on the GPU where there is one: the artifacts are built on the CPU."""
    return load_model("random:tiny", seed=3, device="cuda" if torch.cuda.is_available() else "cpu")


def _method(rerank: float, subspaces: int = 4, centroids: int = 16, follow: int = 0, reselect: int = 1):
    return make_method("csattention", {"subspaces": subspaces, "centroids": centroids, "rerank": rerank,
                                       "follow": follow, "reselect": reselect})


def _artifacts(lm, method):
    cfg = IndexerConfig(kv_dtype="float32", progress=False)
    return [build_artifact(lm, torch.randint(0, lm.args.vocab_size, (n,), generator=torch.Generator().manual_seed(n)),
                           method, cfg) for n in (200, 130, 170)]


@pytest.fixture(scope="module")
def method():
    return _method(1.0)


@pytest.fixture(scope="module")
def artifacts(cpu_lm, method):
    return _artifacts(cpu_lm, method)


def _decode(engine, arts, prompts):
    seqs = [engine.start(f"ctx{i}", a, p, CONFIG, SamplingParams(max_tokens=STEPS))
            for i, (a, p) in enumerate(zip(arts, prompts))]
    return [[t for t, _ in s.tokens(lambda: None)] for s in seqs]


# interpreted on a CPU, every sparse case takes 2-5 minutes (2-core box): rerank4, m16c8 and follow8 run
# in full on a GPU, and on a CPU with `-m slow`; the plain index (rerank1) and dense keep the CPU suite's
# coverage of the runner
CPU_SLOW = () if torch.cuda.is_available() else (pytest.mark.slow,)


@pytest.mark.parametrize("sparse, rerank, index", [
    pytest.param(True, 1.0, (4, 16), id="rerank1"), pytest.param(True, 4.0, (4, 16), id="rerank4", marks=CPU_SLOW),
    pytest.param(False, 1.0, (4, 16), id="dense"), pytest.param(True, 4.0, (16, 8), id="m16c8", marks=CPU_SLOW),
    pytest.param(True, 4.0, (4, 16, 8), id="follow8", marks=CPU_SLOW),
    pytest.param(True, 4.0, (4, 16, 8, 2), id="reselect2", marks=CPU_SLOW),
    pytest.param(True, 4.0, (4, 16, 8, 3), id="reselect3", marks=CPU_SLOW)])
def test_fast_runner_decodes_the_reference_tokens(lm, cpu_lm, sparse, rerank, index, device):
    """rerank 4: the GPU re-ranks the selector's candidates exactly (kernels.rerank.Reranker), as the
    reference's search does (exact_rerank). m16c8: a compact index of many narrow subspaces
    (16 of 2 dims) with few centroids. follow8: CSAttention's follow (the 3-token prompt seeds it).
    reselect2: every other step re-ranks the last selection, its successors and the new key; the
    streams join at different steps, so the engine holds rows to bring them into phase, and steps
    where every row carries replay the lean graph (no selector launches). reselect3: two of three."""
    method = _method(rerank, *index)
    artifacts = _artifacts(cpu_lm, method)
    # the 3-token prompt is admitted while the first stream decodes, a layer per step
    prompts = [[9], [5, 6, 7], []]
    cfg = CONFIG if sparse else SparseConfig(CONFIG.budget, dense_layers=tuple(range(lm.args.n_layers)))
    ref = Engine(ReferenceRunner(lm))
    want = [[t for t, _ in ref.start("x", a, p, cfg, SamplingParams(max_tokens=STEPS)).tokens(lambda: None)]
            for a, p in zip(artifacts, prompts)]
    runner = GpuRunner(lm, method.params if sparse else None, CONFIG, slots=3, max_len=384, max_new=STEPS + 8,
                       prefill_token_layers=1)
    fast = Engine(runner)
    # every context is resident after the first pass: the second loads none (on the CPU, where
    # each interpreted step takes seconds, checked for the plain index only)
    again_too = torch.cuda.is_available() or index == (4, 16) and rerank == 1.0
    try:
        got = _decode(fast, artifacts, prompts)
        again = _decode(fast, artifacts, prompts) if again_too else want
    finally:
        fast.close()
        ref.close()
    assert got == want
    assert again == want
    assert runner.loads == len(artifacts)
    if len(index) > 3:  # most steps carry, and the rows fall into phase: lean steps ran
        assert runner.lean_steps >= STEPS // 2, runner.lean_steps


def test_runner_refuses_what_it_cannot_serve(lm, method, artifacts):
    runner = GpuRunner(lm, method.params, CONFIG, slots=1, max_len=256, max_new=32)
    assert runner.accepts(artifacts[0], CONFIG, 20)
    assert not runner.accepts(artifacts[0], CONFIG, 100)  # past the streamed-key room
    assert not runner.accepts(artifacts[0], SparseConfig(Budget(0.2, 2, 8)), 20)  # another budget
    other = make_method("quest")
    assert not other.gpu_decodable(artifacts[0].layers[0].tables)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="prefill graphs are captured on a CUDA GPU")
@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "dense"])
def test_a_prefill_captured_as_it_runs_gives_the_eager_logits(lm, cpu_lm, sparse, monkeypatch):
    """A question's prefill, a layer a chunk, beside another stream: captured a layer at a time
    as it runs where its admission loaded the slot (Capturing), then replayed; the logits and
    follow's seeds (run beside each layer on a side stream) are an eager prefill's bit for bit,
    and an eager prefill seeding in line gives the same seeds."""
    from ctxcache.decoder.gpu.prefill_graph import PrefillGraphs
    recorded = []
    record = PrefillGraphs.record
    monkeypatch.setattr(PrefillGraphs, "record", lambda self, key, cap, layers, make: (
        recorded.append(layers), record(self, key, cap, layers, make))[1])
    method = _method(4.0, 4, 16, 8)  # the re-rank on: follow seeds
    arts = _artifacts(cpu_lm, method)
    cfg = CONFIG if sparse else SparseConfig(CONFIG.budget, dense_layers=tuple(range(lm.args.n_layers)))

    def runner(graphs: bool) -> GpuRunner:
        made = GpuRunner(lm, method.params if sparse else None, CONFIG, slots=2, max_len=384, max_new=32,
                         prefill_token_layers=1)
        made.prefill_graphs.broken = not graphs
        made.admit("other", arts[1], [4, 5], cfg, 8)  # a stream beside it (the thread's first prefill: eager)
        return made

    def seeds(made: GpuRunner, row: int) -> list[torch.Tensor]:
        return [t.follow_prev[row].sort(-1).values.cpu() for t in made.tables] if sparse else []
    eager_runner = runner(False)
    eager_slot, eager = eager_runner.admit("ctx", arts[0], [5, 6, 7, 8], cfg, 8)
    eager_seeds = seeds(eager_runner, eager_slot.index)
    if sparse:
        assert eager_runner._seed_side is not None  # the seeds below ran beside their layers
        in_line = runner(False)
        in_line._seed_side = None
        got = seeds(in_line, in_line.admit("ctx", arts[0], [5, 6, 7, 8], cfg, 8)[0].index)
        assert all(torch.equal(a, b) for a, b in zip(got, eager_seeds, strict=True))
    graphs, logits, records = runner(True), [], []
    for _ in range(2):
        before = len(recorded)
        slot, first = graphs.admit("ctx", arts[0], [5, 6, 7, 8], cfg, 8)
        logits.append(first)
        records.append(recorded[before:])
        assert all(torch.equal(a, b) for a, b in zip(seeds(graphs, slot.index), eager_seeds, strict=True))
        graphs.release(slot)
    assert records == [[1] * lm.args.n_layers, []]  # each layer captured just before it ran, then replayed
    for got in logits:
        torch.testing.assert_close(got, eager, rtol=0, atol=0)
