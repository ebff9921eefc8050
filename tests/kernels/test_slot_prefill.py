"""A question's prefill padded to its graph's length (slot_prefill.PAD_TO) computes what the
unpadded prefill computes: the first logits, the indexed keys' count and follow's seed. On the
CPU the prefill runs eagerly (the radix Top-K interpreted); on a GPU the padded prefill is also
what a replayed graph runs."""

import pytest
import torch

from ctxcache.decoder.gpu import slot_prefill
from ctxcache.decoder.gpu.runner import GpuRunner
from ctxcache.decoder.reference_attention import SparseConfig
from ctxcache.indexer import IndexerConfig, build_artifact
from ctxcache.methods import Budget, make_method
from ctxcache.models.loader import load_model

CONFIG = SparseConfig(Budget(0.1, 2, 8))


@pytest.fixture(scope="module")
def setup():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cpu_lm = load_model("random:tiny", seed=3)
    method = make_method("csattention", {"subspaces": 4, "centroids": 16, "rerank": 4.0, "follow": 8})
    tokens = torch.randint(0, cpu_lm.args.vocab_size, (130,), generator=torch.Generator().manual_seed(7))
    art = build_artifact(cpu_lm, tokens, method, IndexerConfig(kv_dtype="float32", progress=False))
    return load_model("random:tiny", seed=3, device=device), method, art


def _prefill(lm, method, art, prompt):
    runner = GpuRunner(lm, method.params, CONFIG, slots=1, max_len=256, max_new=64, use_graph=False)
    row, logits = runner.admit("c", art, prompt, CONFIG, 8)
    tables = runner.tables
    return (logits.cpu(), [int(t.stream_count[0]) for t in tables],
            [t.follow_prev[0].sort(-1).values.cpu() for t in tables], int(runner.cache.lengths[0]), row.length)


@pytest.mark.parametrize("tokens", [5, 16, 17])
def test_a_padded_prompt_prefills_as_its_unpadded_self(setup, tokens, monkeypatch):
    lm, method, art = setup
    prompt = list(range(40, 40 + tokens))
    padded = _prefill(lm, method, art, prompt)
    monkeypatch.setattr(slot_prefill, "PAD_TO", 1)
    plain = _prefill(lm, method, art, prompt)
    torch.testing.assert_close(padded[0], plain[0], rtol=1e-4, atol=1e-4)
    assert padded[1] == plain[1] == [tokens] * lm.args.n_layers  # the padding is not indexed
    for p, q in zip(padded[2], plain[2]):
        assert torch.equal(p, q)  # follow seeded from the last real token, padding excluded
    assert padded[3:] == plain[3:] == (130 + tokens, 130 + tokens)


def test_packed_attention_and_fused_seed_prefill_as_the_torch_path(setup, monkeypatch):
    """The two levers `ctxcache bench prefill` measures (on by default): the packed prefill
    attention (spans shortened so a 130-token context packs) and the three-launch seed give the
    first logits, indexed counts and follow seeds of SDPA and the torch seed chain."""
    from ctxcache.kernels import seed_probs
    from ctxcache.models import packed_attention
    lm, method, art = setup
    prompt = list(range(40, 57))
    monkeypatch.setattr(slot_prefill, "PACKED_ATTENTION", False)
    monkeypatch.setattr(seed_probs, "FUSED_SEED", False)
    want = _prefill(lm, method, art, prompt)
    monkeypatch.setattr(slot_prefill, "PACKED_ATTENTION", True)
    monkeypatch.setattr(packed_attention, "MIN_SPAN", 32)
    monkeypatch.setattr(seed_probs, "FUSED_SEED", True)
    calls = {"packed": 0, "fused": 0}

    def counted(name, fn):
        def run(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return run
    monkeypatch.setattr(slot_prefill, "packed_appended_attention", counted("packed", slot_prefill.packed_appended_attention))
    monkeypatch.setattr(seed_probs, "seed_probs", counted("fused", seed_probs.seed_probs))
    got = _prefill(lm, method, art, prompt)
    assert calls["packed"] == calls["fused"] == lm.args.n_layers  # both levers ran in every layer
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
    assert got[1] == want[1]
    for g, w in zip(got[2], want[2]):
        assert torch.equal(g, w)
    assert got[3:] == want[3:]


def test_a_cold_admission_prefills_as_it_loads_and_answers_as_a_resident_one(setup):
    """A slot's first prompt runs a layer at a time as the context's layers land (the load and
    the prefill overlap); the same prompt on the now resident context (its own prefill after
    the reset) gives the same first logits, index counts and follow seeds."""
    lm, method, art = setup
    runner = GpuRunner(lm, method.params, CONFIG, slots=1, max_len=256, max_new=64, use_graph=False)
    prompt = list(range(40, 57))

    def ask():
        slot, logits = runner.admit("c", art, prompt, CONFIG, 8)
        state = ([int(t.stream_count[0]) for t in runner.tables],
                 [t.follow_prev[0].sort(-1).values.cpu() for t in runner.tables], int(runner.cache.lengths[0]))
        slot.busy = False
        return logits.cpu(), state

    cold, warm = ask(), ask()
    assert runner.loads == 1
    torch.testing.assert_close(cold[0], warm[0], rtol=0, atol=0)
    assert cold[1][0] == warm[1][0] == [len(prompt)] * lm.args.n_layers
    assert all(torch.equal(a, b) for a, b in zip(cold[1][1], warm[1][1]))
    assert cold[1][2] == warm[1][2] == 130 + len(prompt)


def test_a_reset_clears_the_row_in_every_layer_in_one_call(setup, monkeypatch):
    """A hot admission's reset reaches the row of every layer through one reset_stream over the
    layers' common allocation (a launch a field, not a field and layer), and no other row."""
    from ctxcache.decoder.gpu.tables import GpuDenseTables
    lm, method, art = setup
    runner = GpuRunner(lm, method.params, CONFIG, slots=2, max_len=256, max_new=64, use_graph=False)
    slots = [runner.admit(cid, art, list(range(40, 57)), CONFIG, 8)[0] for cid in ("a", "b")]
    kept = [(int(t.stream_count[1]), t.follow_prev[1].clone()) for t in runner.tables]
    calls = []
    reset = GpuDenseTables.reset_stream
    monkeypatch.setattr(GpuDenseTables, "reset_stream", lambda self, row: (calls.append(row), reset(self, row))[1])
    with torch.inference_mode():  # as the runner's admissions run
        runner._reset(slots[0])
    assert len(calls) == 1
    for t, (count, follow) in zip(runner.tables, kept):
        assert int(t.stream_count[0]) == 0 and torch.all(t.follow_prev[0] == -1)
        assert int(t.stream_start[0]) == int(t.n_ctx[0]) == art.n_tokens
        assert int(t.stream_count[1]) == count > 0 and torch.equal(t.follow_prev[1], follow)
