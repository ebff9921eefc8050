"""An offloaded row's question prefill padded to a graph's length (OffloadRunner(prefill_graphs=True),
offload_prompt.py) computes what today's unpadded prefill computes (its integer state exactly, its
values to the last bits that a product's row count changes), and its padding leaves no trace:
other padding tokens give every real output and every state the decode steps read bit for bit.
On a CPU PrefillGraphs runs nothing (its prefill is eager and padded: the path a capture records);
on a GPU the captured and replayed prefill's logits equal the eager one's. A random fp32 model of
4 layers; on CPU the Triton kernels run interpreted."""

from dataclasses import replace
from functools import lru_cache

import pytest
import torch

from ctxcache.decoder.gpu import offload_prompt
from ctxcache.decoder.gpu.offload_runner import OffloadRunner
from ctxcache.decoder.gpu.prefill_graph import PrefillGraphs
from ctxcache.decoder.gpu.slot_prefill import PAD_TO
from ctxcache.decoder.reference_attention import SparseConfig
from ctxcache.indexer import IndexerConfig, build_artifact
from ctxcache.methods import Budget, make_method
from ctxcache.models import config as model_config
from ctxcache.models.loader import load_model

CONFIG = SparseConfig(Budget(0.1, 2, 8))
pytestmark = pytest.mark.usefixtures("small_score_pad")  # kernels/conftest.py: why
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
N_CTX = 150
MODES = {"k-hbm": {}, "v-int8": {"v_int8": True}}


@lru_cache(maxsize=None)
def _setup(coded: bool):
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(model_config.NAMED_CONFIGS, "tiny4", replace(model_config.NAMED_CONFIGS["tiny"], n_layers=4))
        lm = load_model("random:tiny4", seed=3, device=DEVICE)
        cpu_lm = load_model("random:tiny4", seed=3)
    method = make_method("csattention", {"subspaces": 4, "centroids": 16, "rerank": 2.0})  # follow on
    tokens = torch.randint(0, lm.args.vocab_size, (N_CTX,), generator=torch.Generator().manual_seed(N_CTX))
    art = build_artifact(cpu_lm, tokens, method, IndexerConfig(kv_dtype="float32", progress=False, coded_kv=coded))
    return lm, method, art


def _runner(mode: str, graphs: bool, **kw) -> tuple[OffloadRunner, object]:
    lm, method, art = _setup(mode == "v-int8")
    runner = OffloadRunner(lm, method.params, CONFIG, slots=1, max_len=320, max_new=64, prefill_layers=1,
                           prefill_graphs=graphs, **MODES[mode], **kw)
    return runner, art


EXACT = ("counts", "lengths", "follow", "after_steps_counts")  # integers (follow: key positions)


@lru_cache(maxsize=None)
def _hot_question(mode: str, graphs: bool, prompt: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """The context loaded (its stream released), then a question on it a layer a chunk, then two
    greedy steps: what the prefill left at the real positions, and the steps' logits."""
    runner, art = _runner(mode, graphs)
    runner.release(runner.admit("c", art, [5, 6], CONFIG, 4)[0])
    slot, first = runner.admit("c", art, list(prompt), CONFIG, 4)
    n, t, real = N_CTX, runner.tables, N_CTX + len(prompt)
    got = {"logits": first, "follow": torch.stack([x.follow_prev[0] for x in t]),
           "overlay": torch.stack([x.new_scores[0, ..., :len(prompt)] for x in t]),
           "counts": torch.stack([torch.stack((x.stream_count[0], x.stream_start[0], x.n_ctx[0])) for x in t]),
           "lengths": torch.stack((runner.pool.lengths[0], torch.tensor(slot.length, device=DEVICE))),
           "k": torch.stack([k[0, :, :real] for k in runner.kv.k]),
           "v": torch.stack([v[0, :, :len(prompt)] if mode == "v-int8" else v[0, :, :real] for v in runner.pool.v])}
    steps, tok = [], int(first.argmax())
    for _ in range(2):
        steps.append(runner.step([slot], [tok]))
        tok = int(steps[-1].argmax())
    got["steps"] = torch.stack(steps)
    got["after_steps_counts"] = torch.stack([x.stream_count[0] for x in t])
    return got


# 33 tokens (padded to 48) is the 17-token case's path with another bucket: left out for CI's time
@pytest.mark.parametrize("mode, tokens", [("k-hbm", 1), ("k-hbm", 15), ("k-hbm", 16), ("k-hbm", 17), ("v-int8", 17)])
def test_a_padded_offloaded_prompt_leaves_what_the_unpadded_one_leaves(mode, tokens):
    """Padded to 16, 16, 32 (a 1-token question is a decode step either way): the streamed-key
    counts (the padding is not indexed), lengths and follow seed exactly; the first logits, the
    index overlay's real columns, the K and V written at the real positions and two following
    steps' logits within 1e-4 (observed ~3e-7 on the CPU: BLAS blocks a 17-row and a 32-row
    product differently, so one token's row differs in its last bits; the test below fixes the
    shapes and compares bit for bit), and the same greedy tokens."""
    prompt = tuple(range(20, 20 + tokens))
    want = _hot_question(mode, False, prompt)
    got = _hot_question(mode, True, prompt)
    for name in EXACT:
        assert torch.equal(got[name], want[name]), name
    for name in set(want) - set(EXACT):
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-4, msg=name)
    assert torch.equal(got["steps"].argmax(-1), want["steps"].argmax(-1))
    if tokens > 1:
        assert want["counts"][:, 0].tolist() == [tokens] * 4


@pytest.mark.parametrize("mode, tokens", [("k-hbm", 15), ("k-hbm", 17), ("v-int8", 17)])
def test_the_padding_leaves_no_trace_in_the_row(mode, tokens, monkeypatch):
    """The same padded prompt with other padding tokens (so each pad key, value and query
    differs): every real output and every state a decode step reads is the same bit for bit
    (the padding is not attended by real queries, indexed, seeded from, nor read by the steps,
    which write over its positions), and so are the next two steps' logits."""
    prompt = tuple(range(20, 20 + tokens))
    want = _hot_question(mode, True, prompt)
    pad = offload_prompt.prompt_input

    def other_padding(tokens_: list[int], padded: int, device: torch.device) -> torch.Tensor:
        out = pad(tokens_, padded, device)
        out[0, len(tokens_):padded] = torch.arange(7, 7 + padded - len(tokens_))
        return out
    monkeypatch.setattr(offload_prompt, "prompt_input", other_padding)
    got = _hot_question.__wrapped__(mode, True, prompt)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_the_warm_up_checks_the_replayed_prefill_against_the_eager_one(monkeypatch):
    """With prefill graphs and the serial copy the warm-up asks slot 0's 16-token question again
    (replayed on a GPU; eager here) and compares the logits with its first, eager ones: equal, the
    graphs stay on; a replay that differs turns them off before serving. Pipelined: no check."""
    from ctxcache.decoder.gpu import warm_up
    checked = []
    check = warm_up._check_prefill_graph
    monkeypatch.setattr(warm_up, "_check_prefill_graph", lambda r, *a: (checked.append(r), check(r, *a))[1])
    _, art = _runner("k-hbm", True)

    def warmed(**kw) -> OffloadRunner:
        runner = _runner("k-hbm", True, **kw)[0]
        runner.warm_up([art])
        return runner
    good = warmed()
    assert checked == [good] and not good.prefill_graphs.broken
    wrong = _runner("k-hbm", True)[0]
    asked = wrong.prefill_graphs.prefill

    class Off:  # the check's admissions (after the first prefill) replay 1 too high
        def __init__(self, run):
            self.run_, self.layer = run, 0

        def run(self, layers):
            out = self.run_.run(layers)
            self.layer = self.run_.layer
            return None if out is None else out + 1
    count = []

    def prefill(key, ids, n_layers, make, first_use=False):
        count.append(key)
        run = asked(key, ids, n_layers, make, first_use)  # on a GPU the check's are a capture, then a replay
        return Off(run or make(ids)) if len(count) > 1 else run
    wrong.prefill_graphs.prefill = prefill
    wrong.warm_up([art])
    assert checked[-1] is wrong and wrong.prefill_graphs.broken
    piped = warmed(pipelined_prefill=True)
    assert checked[-1] is wrong and not piped.prefill_graphs.broken  # no check ran


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="prefill graphs are captured on a CUDA GPU")
@pytest.mark.parametrize("mode", sorted(MODES))
def test_an_offloaded_prefill_captured_as_it_runs_gives_the_eager_logits(mode, monkeypatch):
    """A question's prefill, a layer a chunk, beside another stream: captured a layer at a time
    as it runs where its admission loaded the row (Capturing), then replayed on the hot row; the
    logits, and the next step's, are the eager (padded) prefill's bit for bit."""
    recorded = []
    record = PrefillGraphs.record
    monkeypatch.setattr(PrefillGraphs, "record", lambda self, key, cap, layers, make: (
        recorded.append(layers), record(self, key, cap, layers, make))[1])
    lm, method, art = _setup(mode == "v-int8")
    prompt = [5, 6, 7, 8]

    def runner(graphs: bool) -> OffloadRunner:
        made = OffloadRunner(lm, method.params, CONFIG, slots=2, max_len=320, max_new=64, prefill_layers=1,
                             prefill_graphs=True, **MODES[mode])
        made.prefill_graphs.broken = not graphs
        made.admit("other", art, [4, 5], CONFIG, 8)  # a stream beside it (the thread's first prefill: eager)
        return made

    def ask(r: OffloadRunner) -> tuple[torch.Tensor, torch.Tensor]:
        slot, first = r.admit("ctx", art, prompt, CONFIG, 8)
        step = r.step([slot], [int(first.argmax())])
        r.release(slot)
        return first, step
    want = ask(runner(False))
    graphs, got, records = runner(True), [], []
    for _ in range(2):
        before = len(recorded)
        got.append(ask(graphs))
        records.append(recorded[before:])
    assert records == [[1] * lm.args.n_layers, []]  # each layer captured just before it ran, then replayed
    assert not graphs.prefill_graphs.broken
    for first, step in got:
        torch.testing.assert_close(first, want[0], rtol=0, atol=0)
        torch.testing.assert_close(step, want[1], rtol=0, atol=0)
