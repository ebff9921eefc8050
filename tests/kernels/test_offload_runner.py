"""The offload runner (K/V in host slots of one page-locked pool, a GPU slot cache of selected
keys, every stream in one batched step) against the reference runner, and its batched step
against the same rows stepped one at a time (a random fp32 model; on CPU the Triton kernels run
interpreted and "host" memory is plain CPU memory)."""

import pytest
import torch

from ctxcache.decoder.engine import Engine
from ctxcache.decoder.gpu import offload_step
from ctxcache.decoder.gpu.offload_runner import OffloadRunner
from ctxcache.decoder.reference_attention import SparseConfig
from ctxcache.decoder.runner import ReferenceRunner
from ctxcache.generation import SamplingParams
from ctxcache.indexer import IndexerConfig, build_artifact
from ctxcache.methods import Budget, make_method
from ctxcache.models.loader import load_model

CONFIG = SparseConfig(Budget(0.1, 2, 8))
pytestmark = pytest.mark.usefixtures("small_score_pad")  # kernels/conftest.py: why
STEPS = 48 if torch.cuda.is_available() else 4
# interpreted on a CPU each case takes 50-75 s of CI's 2 cores: rerank 4 runs on a GPU and with -m slow
CPU_SLOW = () if torch.cuda.is_available() else (pytest.mark.slow,)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _artifacts(method, lengths):
    cpu_lm = load_model("random:tiny", seed=3)
    cfg = IndexerConfig(kv_dtype="float32", progress=False)
    return [build_artifact(cpu_lm, torch.randint(0, cpu_lm.args.vocab_size, (n,),
                                                 generator=torch.Generator().manual_seed(n)), method, cfg)
            for n in lengths]


@pytest.mark.parametrize("rerank, reselect", [(1.0, 1), pytest.param(4.0, 1, marks=CPU_SLOW),
                                              pytest.param(4.0, 2, marks=CPU_SLOW)])
def test_offload_runner_decodes_the_reference_tokens(rerank, reselect):
    """reselect 2: every other step a row attends its last selection, its best keys' successors
    and the new key through the slot caches (the -1 after them never read nor cached)."""
    lm = load_model("random:tiny", seed=3, device=DEVICE)
    method = make_method("csattention", {"subspaces": 4, "centroids": 16, "rerank": rerank, "reselect": reselect})
    arts = _artifacts(method, (200, 150))
    prompts = [[5, 6, 7], []]
    ref, off = Engine(ReferenceRunner(lm)), Engine(OffloadRunner(lm, method.params, CONFIG, slots=2, max_len=320))
    try:
        want = [[t for t, _ in ref.start("x", a, p, CONFIG, SamplingParams(max_tokens=STEPS)).tokens(lambda: None)]
                for a, p in zip(arts, prompts)]
        seqs = [off.start(f"c{i}", a, p, CONFIG, SamplingParams(max_tokens=STEPS)) for i, (a, p) in enumerate(zip(arts, prompts))]
        got = [[t for t, _ in s.tokens(lambda: None)] for s in seqs]
    finally:
        off.close()
        ref.close()
    assert got == want
    hits, selected = off.runner.offload_hits()
    assert selected > 0 and 0 <= hits <= selected  # the slot caches saw every selected key


def test_reselect_needs_a_slot_cache_of_its_candidates():
    lm = load_model("random:tiny", seed=3, device=DEVICE)
    params = make_method("csattention", {"subspaces": 4, "centroids": 16, "reselect": 2}).params
    with pytest.raises(ValueError, match="v_cache=1.0 holds"):
        OffloadRunner(lm, params, CONFIG, slots=1, max_len=320, v_cache=1.0)


def test_one_batched_step_gives_the_logits_of_rows_stepped_one_at_a_time(monkeypatch):
    """Three streams of different lengths (a 3-token prompt, none, a 1-token prompt) step
    together in one runner; after two steps one leaves and another context joins its host slot.
    Each step of the batch is one model pass whose attention runs once per layer over the whole
    bucket, and gives the logits of each stream stepped alone (a runner of one slot each)."""
    lm = load_model("random:tiny", seed=3, device=DEVICE)
    method = make_method("csattention", {"subspaces": 4, "centroids": 16, "rerank": 1.0})
    arts = _artifacts(method, (200, 150, 170, 120))
    batched = OffloadRunner(lm, method.params, CONFIG, slots=3, max_len=320, max_new=32)
    alone = [OffloadRunner(lm, method.params, CONFIG, slots=1, max_len=320, max_new=32) for _ in range(3)]
    calls = []
    attend = offload_step.offload_attention
    monkeypatch.setattr(offload_step, "offload_attention", lambda q, *a, **k: (calls.append(q.shape[0]), attend(q, *a, **k))[1])

    def admit(runner, i, prompt):
        row, first = runner.admit(f"c{i}", arts[i], prompt, CONFIG, 16)
        return row, int(first.argmax())
    prompts = ([5, 6, 7], [], [9])
    together = [admit(batched, i, p) for i, p in enumerate(prompts)]
    apart = [admit(r, i, p) for i, (r, p) in enumerate(zip(alone, prompts))]
    for step in range(4):
        if step == 2:  # the second stream leaves, a fourth context joins (into its freed slot)
            batched.release(together[1][0])
            together[1] = admit(batched, 3, [8, 4])
            alone[1].release(apart[1][0])
            apart[1] = admit(alone[1], 3, [8, 4])
        rows, toks = zip(*together)
        calls.clear()
        got = batched.step(list(rows), list(toks))
        if DEVICE == "cpu":  # on a GPU the step is a graph replay: no Python call to count
            assert calls == [3] * lm.args.n_layers  # one attention launch a layer for the bucket of 3 slots
        want = torch.cat([r.step([row], [tok]) for r, (row, tok) in zip(alone, apart)])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
        together = [(row, int(t)) for (row, _), t in zip(together, got.argmax(-1))]
        apart = [(row, int(t)) for (row, _), t in zip(apart, want.argmax(-1))]
    assert [s.index for s, _ in together] == [0, 1, 2]
    assert batched.loads == 4 and batched.offload_hits()[1] > 0


def test_a_released_context_stays_in_its_host_slot():
    """The next stream on a context whose stream ended skips the load (the hot TTFT of an
    offloaded context is its prompt's prefill) and starts from the context's end."""
    lm = load_model("random:tiny", seed=3, device=DEVICE)
    method = make_method("csattention", {"subspaces": 4, "centroids": 16, "rerank": 1.0})
    art = _artifacts(method, (150,))[0]
    runner = OffloadRunner(lm, method.params, CONFIG, slots=2, max_len=320, max_new=32)
    firsts = []
    for _ in range(2):
        row, first = runner.admit("c", art, [5, 6, 7], CONFIG, 8)
        firsts.append(first)
        runner.step([row], [int(first.argmax())])
        runner.release(row)
    assert runner.loads == 1 and row.length == 150
    torch.testing.assert_close(firsts[1], firsts[0], rtol=0, atol=0)


def test_offload_runner_refuses_what_its_host_slots_cannot_hold():
    lm = load_model("random:tiny", seed=3, device=DEVICE)
    method = make_method("csattention", {"subspaces": 4, "centroids": 16, "rerank": 1.0})
    art = _artifacts(method, (200,))[0]
    runner = OffloadRunner(lm, method.params, CONFIG, slots=1, max_len=300, max_new=64)
    assert runner.max_len == 512  # slot lengths are rounded up to 256 tokens
    assert runner.accepts(art, CONFIG, 64) and not runner.accepts(art, CONFIG, 65)  # the index overlay's room
    assert not OffloadRunner(lm, method.params, CONFIG, slots=1, max_len=256).accepts(art, CONFIG, 60)
    assert not runner.accepts(art, SparseConfig(Budget(0.2, 2, 8)), 8)
    with pytest.raises(ValueError, match="offload slots=0"):
        OffloadRunner(lm, method.params, CONFIG, slots=0)
    with pytest.raises(ValueError, match="attention_waves=0"):
        OffloadRunner(lm, method.params, CONFIG, slots=1, attention_waves=0)


def test_the_warm_up_runs_every_bucket_and_leaves_the_slots_free():
    """Every bucket's step (its graph on a GPU) is built before serving; the warm-up's contexts
    leave no host slot behind."""
    lm = load_model("random:tiny", seed=3, device=DEVICE)
    method = make_method("csattention", {"subspaces": 4, "centroids": 16, "rerank": 1.0})
    runner = OffloadRunner(lm, method.params, CONFIG, slots=3, max_len=256, max_new=32)
    runner.warm_up(_artifacts(method, (150, 300)))  # the second is longer than a slot: skipped
    assert sorted(runner._decoders) == runner.buckets == [1, 2, 3]
    assert all(d.graph is not None for d in runner._decoders.values()) or not torch.cuda.is_available()
    assert runner.loads == 3 and all(not s.busy and s.context_id is None for s in runner.slots)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: compiles the bf16 kernels")
def test_offload_runner_serves_a_bf16_model_at_an_unaligned_length():
    """A bf16 model (16-bit re-rank keys) of SmolLM2's shapes and a context + question + answer of
    no round length: the kernels compile and the stream decodes (an unaligned cache length once
    broke the compiler at Llama-3.1-8B shapes and took the server down)."""
    lm = load_model("random:smollm2-135m", seed=3, dtype=torch.bfloat16, device="cuda")
    method = make_method("csattention", {"subspaces": 4, "centroids": 16})
    art = build_artifact(lm, torch.randint(0, lm.args.vocab_size, (333,), generator=torch.Generator().manual_seed(1)),
                         method, IndexerConfig(kv_dtype="bfloat16", progress=False))
    eng = Engine(OffloadRunner(lm, method.params, CONFIG, slots=2, max_len=333 + 3 + 7))
    try:
        seq = eng.start("c", art, [5, 6, 7], CONFIG, SamplingParams(max_tokens=7))
        assert len([t for t, _ in seq.tokens(lambda: None)]) == 7
    finally:
        eng.close()
