"""A batched step computes a throw-away token for the rows of its bucket it does not step. The
throw-away's re-rank must not rewrite the follow state (CSAttention's previous best keys) of a
stream holding such a row: a stream decoding while another's one-token question is admitted
(that admission is a step of the whole bucket), or a stream whose question's prefill runs a
chunk of layers between two steps of the others. Both runners (a random fp32 model of 4
layers; on CPU the Triton kernels run interpreted, "host" memory is plain CPU memory)."""

from dataclasses import replace

import pytest
import torch

from ctxcache.decoder.gpu.offload_runner import OffloadRunner
from ctxcache.decoder.gpu.runner import GpuRunner
from ctxcache.decoder.reference_attention import SparseConfig
from ctxcache.indexer import IndexerConfig, build_artifact
from ctxcache.methods import Budget, make_method
from ctxcache.models import config as model_config
from ctxcache.models.loader import load_model

CONFIG = SparseConfig(Budget(0.1, 2, 8))
pytestmark = pytest.mark.usefixtures("small_score_pad")  # kernels/conftest.py: why
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
JOINER_PROMPT = list(range(20, 34))
# interpreted on a CPU each case takes 0.5-3 min of the 2-core box: the offload runner's there with -m slow
CPU_SLOW = () if torch.cuda.is_available() else (pytest.mark.slow,)
KINDS = ["resident", pytest.param("offloaded", marks=CPU_SLOW)]


@pytest.fixture(scope="module")
def setup():
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(model_config.NAMED_CONFIGS, "tiny4", replace(model_config.NAMED_CONFIGS["tiny"], n_layers=4))
        lm = load_model("random:tiny4", seed=3, device=DEVICE)
        cpu_lm = load_model("random:tiny4", seed=3)
    method = make_method("csattention", {"subspaces": 4, "centroids": 16, "rerank": 2.0})  # follow on
    cfg = IndexerConfig(kv_dtype="float32", progress=False)
    arts = [build_artifact(cpu_lm, torch.randint(0, cpu_lm.args.vocab_size, (n,),
                                                 generator=torch.Generator().manual_seed(n)), method, cfg)
            for n in (200, 150)]
    return lm, method, arts


RUNNERS = {
    "resident": lambda lm, params: GpuRunner(lm, params, CONFIG, slots=2, max_len=320, max_new=32,
                                             prefill_token_layers=1),
    "offloaded": lambda lm, params: OffloadRunner(lm, params, CONFIG, slots=2, max_len=320, max_new=32,
                                                  prefill_layers=1),
}


def _follow(runner, row: int) -> list[torch.Tensor]:
    return [t.follow_prev[row].clone() for t in runner.tables]


def _a_decoding(runner, arts, b_first: bool):
    """a decoding in slot 1 after b was held in slot 0 (a's steps then run bucket 2), else in
    slot 0 (b's admission into slot 1 then runs bucket 2)."""
    if b_first:
        runner.release(runner.admit("b", arts[1], [5, 6], CONFIG, 4)[0])
    a, first_a = runner.admit("a", arts[0], [5, 6, 7], CONFIG, 8)
    return a, runner.step([a], [int(first_a.argmax())])[0]


@pytest.mark.parametrize("kind", KINDS)
def test_a_one_token_admission_leaves_a_decoding_stream_as_it_was(setup, kind):
    lm, method, arts = setup
    runner = RUNNERS[kind](lm, method.params)
    a, logits_a = _a_decoding(runner, arts, b_first=False)
    before = _follow(runner, a.index)
    assert any(bool((s >= 0).any()) for s in before)  # a follows keys: there is state to lose
    b, _ = runner.admit("b", arts[1], [9], CONFIG, 4)  # one token: a decode step over bucket 2
    assert (a.index, b.index) == (0, 1)
    for layer, (got, want) in enumerate(zip(_follow(runner, a.index), before)):
        assert torch.equal(got, want), layer
    # and a's next step is the one it takes with no admission beside it
    alone = RUNNERS[kind](lm, method.params)
    a2, logits_a2 = _a_decoding(alone, arts, b_first=False)
    torch.testing.assert_close(runner.step([a], [int(logits_a.argmax())])[0],
                               alone.step([a2], [int(logits_a2.argmax())])[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_steps_between_a_prefills_chunks_leave_its_follow_state_as_a_lone_prefill_does(setup, kind):
    """b's prefill runs a layer a chunk; a steps between every two chunks and after the last
    (bucket 2: b's idle row computes a throw-away token each time). b's follow state and first
    step's logits are those of the same prefill run with no step beside it."""
    lm, method, arts = setup

    def joined(steps_beside: bool):
        runner = RUNNERS[kind](lm, method.params)
        a, logits_a = _a_decoding(runner, arts, b_first=True)
        b, chunks = runner.begin("b", arts[1], JOINER_PROMPT, CONFIG, 4)
        while (first_b := next(chunks)) is None:
            if steps_beside:
                logits_a = runner.step([a], [int(logits_a.argmax())])[0]
        if steps_beside:
            logits_a = runner.step([a], [int(logits_a.argmax())])[0]
        state = _follow(runner, b.index)
        return state, runner.step([a, b], [int(logits_a.argmax()), int(first_b.argmax())])[1]

    want_state, want = joined(False)
    got_state, got = joined(True)
    assert any(bool((s >= 0).any()) for s in want_state)
    for layer, (g, w) in enumerate(zip(got_state, want_state)):
        assert torch.equal(g, w), layer
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
