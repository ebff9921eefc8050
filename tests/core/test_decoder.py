"""Indexer + sparse decoder end to end on the tiny random model."""

import pytest
import torch

from ctxcache.decoder import ArtifactMismatch, SparseConfig, generate
from ctxcache.generation import SamplingParams
from ctxcache.indexer import IndexerConfig, build_artifact
from ctxcache.methods import Budget, Capabilities, MethodParams, SparseMethod, make_method
from ctxcache.models.loader import load_model

QUIET = IndexerConfig(progress=False, kv_dtype="float32")


@pytest.fixture(scope="module")
def tiny():
    return load_model("random:tiny")


def _tokens(lm, n, seed):
    return torch.randint(0, lm.args.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(lm, arts, prompts, n=6, config=SparseConfig(Budget(0.1, 2, 8))):
    return [t.tolist() for t, _ in generate(lm, arts, prompts, SamplingParams(max_tokens=n), config)]


def test_batch_of_two_contexts_equals_each_alone(tiny):
    method = make_method("csattention", {"subspaces": 4, "centroids": 16})
    a = build_artifact(tiny, _tokens(tiny, 300, 1), method, QUIET)
    b = build_artifact(tiny, _tokens(tiny, 170, 2), method, QUIET)
    pa, pb = _tokens(tiny, 5, 3), _tokens(tiny, 5, 4)
    together = _run(tiny, [a, b], [pa, pb])
    alone_a, alone_b = _run(tiny, [a], [pa]), _run(tiny, [b], [pb])
    assert [s[0] for s in together] == [s[0] for s in alone_a]
    assert [s[1] for s in together] == [s[0] for s in alone_b]


def test_one_token_context_and_empty_prompt(tiny):
    art = build_artifact(tiny, [7], make_method("csattention"), QUIET)
    steps = _run(tiny, [art], [[]], n=3)
    assert len(steps) == 3 and steps[0][0] == int(art.last_logits.argmax())


def test_context_at_model_maximum_length(tiny):
    n = tiny.args.max_seq_len - 1
    art = build_artifact(tiny, _tokens(tiny, n, 5), make_method("csattention", {"subspaces": 4}), QUIET)
    steps = list(generate(tiny, [art], [[]], SamplingParams(max_tokens=10)))
    assert len(steps) == 2 and bool(steps[-1][1][0])  # one decoded token fills the last slot
    with pytest.raises(ValueError, match="maximum length"):
        build_artifact(tiny, _tokens(tiny, n + 1, 5), make_method("oracle"), QUIET)


def test_keep_all_sparse_decode_equals_dense(tiny):
    art = build_artifact(tiny, _tokens(tiny, 200, 6), make_method("csattention", {"subspaces": 4}), QUIET)
    prompt = _tokens(tiny, 4, 7)
    sparse = _run(tiny, [art], [prompt], n=8, config=SparseConfig(Budget(1.0, 4, 32)))
    dense = _run(tiny, [art], [prompt], n=8, config=SparseConfig(Budget(0.05), dense_layers=(0, 1)))
    assert sparse == dense


def test_search_period_reuses_selection(tiny):
    art = build_artifact(tiny, _tokens(tiny, 400, 8), make_method("csattention", {"subspaces": 4}), QUIET)
    cfg = SparseConfig.from_schedule("0.15-step-4", sinks=2, recent=8)
    assert cfg.period == 4 and cfg.budget.keep == 0.15
    assert len(_run(tiny, [art], [_tokens(tiny, 3, 9)], n=9, config=cfg)) == 9
    with pytest.raises(ValueError, match="keep-step-period"):
        SparseConfig.from_schedule("fast")


@pytest.mark.parametrize("schedule", ["0.05-step-\u0663", "0.05-step-1\n", "\u0660.05-step-1", "0.05-step-\uff11",
                                      " 0.05-step-1", "0.05-step-1 "])
def test_schedule_is_ascii_and_matched_whole(schedule):
    with pytest.raises(ValueError, match="keep-step-period"):
        SparseConfig.from_schedule(schedule)


def test_artifact_from_another_model_is_refused(tiny):
    art = build_artifact(tiny, _tokens(tiny, 50, 10), make_method("oracle"), QUIET)
    art.model_id = "someone-else"
    with pytest.raises(ArtifactMismatch, match="someone-else"):
        _run(tiny, [art], [[1]])


def test_uninitialized_cache_rows_are_fully_defined_after_load(tiny):
    cache = tiny.model.new_cache(2, 64, uninitialized=True)
    for layer in range(len(cache.k)):  # poison, as stale memory could be
        cache.k[layer].fill_(float("nan"))
        cache.v[layer].fill_(float("nan"))
    ks = [torch.randn(tiny.args.n_kv_heads, 10, tiny.args.head_dim) for _ in cache.k]
    cache.load_row(0, ks, ks)
    cache.load_row(1, [k[:, :3] for k in ks], [k[:, :3] for k in ks])
    assert all(torch.isfinite(k).all() and torch.isfinite(v).all() for k, v in zip(cache.k, cache.v))


class _PaddedEstimator(SparseMethod):
    """An estimator whose attend reads 3 distinct keys in head 0 (row padded by repeating its
    last index) and 5 in head 1, like MagicPIG's padded_indices."""

    name = "padded"
    Params = MethodParams
    caps = Capabilities(estimator=True)

    def build(self, q, k, v):
        return {}

    def search(self, state, q, keys, lo, hi, k):
        raise AssertionError("an estimator's attend does not search")

    pad = 2  # how head 0's row is padded: its last index repeated, or -1 (CSAttention's carried steps)

    def attend(self, state, q, keys, values, n, budget):
        return torch.zeros_like(q), torch.tensor([[0, 1, 2, self.pad, self.pad], [0, 1, 2, 3, 4]])


def test_estimator_read_count_counts_distinct_indices_not_padding():
    from ctxcache.decoder.reference_attention import ReferenceSparseAttention
    from ctxcache.methods.budget import distinct_valid

    assert distinct_valid(torch.tensor([[3, 3, 1, -1], [5, 6, 7, 8]])).tolist() == [2, 4]
    attn = ReferenceSparseAttention(_PaddedEstimator(), [[_PaddedEstimator().open({})]], SparseConfig(Budget(0.1, 2, 2)))
    keys = torch.zeros(2, 10, 8)
    attn._row(0, 0, torch.zeros(4, 8), type("C", (), {"k": [keys[None]], "v": [keys[None]]})(), 10)
    assert attn.keys_read == 8 and attn.keys_total == 20  # the old count said 10


@pytest.mark.parametrize("pad", [2, -1])
def test_selection_metrics_keys_read_frac_counts_distinct_indices(pad):
    from ctxcache.quality.capture import Captured
    from ctxcache.quality.selection import selection_metrics

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(4, 11, 8, generator=gen)
    k, v = torch.randn(2, 11, 8, generator=gen), torch.randn(2, 11, 8, generator=gen)
    cap = Captured(n_context=10, q=[q], k=[k], v=[v], logits=None)
    method = _PaddedEstimator()
    method.pad = pad
    got = selection_metrics(method, [{}], cap, Budget(0.1, 2, 2), stride=1)
    assert got["keys_read_frac"] == pytest.approx((3 + 5) / 2 / 11)  # the old value was 5 / 11
