"""Every registered method honours the one interface: registry, search contract, and keep=100%
equals dense attention through the decoder on the tiny random model."""

from __future__ import annotations

import pytest
import torch

from ctxcache.decoder.session import start_batch
from ctxcache.decoder.reference_attention import SparseConfig
from ctxcache.generation import decode_one_token, prefill
from ctxcache.indexer.build import IndexerConfig, build_artifact
from ctxcache.methods import METHODS, Budget, make_method
from ctxcache.models.attention import dense_attention
from ctxcache.models.loader import load_model

from .helpers import make_qkv

NAMES = sorted(METHODS)
# params under which keep = 100% must equal dense attention (MagicPIG samples every key with
# u ~ 1 only when one bit per table and many tables make collisions near certain)
FULL = {"magicpig": {"bits": 1, "tables": 400}}


def test_registry_errors():
    with pytest.raises(ValueError, match="unknown method 'nope'.*magicpig"):
        make_method("nope")
    for name in NAMES:
        with pytest.raises(ValueError, match="unknown parameter"):
            make_method(name, {"no_such_param": 1})


@pytest.mark.parametrize("name,bad", [
    ("magicpig", {"bits": 0}), ("magicpig", {"min_collisions": 3}), ("ctkvr", {"recall": 0}),
    ("prehoc", {"block": 0}), ("prehoc", {"phi": 1.5}), ("multipole", {"tokens_per_cluster": 0}),
    ("quest", {"page": 0})])
def test_bad_params_name_the_value(name, bad):
    key, value = next(iter(bad.items()))
    with pytest.raises(ValueError, match=f"{key}={value}"):
        make_method(name, bad)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n,keep,sinks,recent", [
    (300, 0.1, 4, 16), (40, 1.0, 4, 8), (20, 0.5, 4, 32), (1, 0.05, 4, 32), (2, 1.0, 0, 0)])
def test_select_contract(name, n, keep, sinks, recent):
    q, k, v, qd = make_qkv(n=n)
    method = make_method(name)
    state = method.open(method.build(q, k, v))
    budget = Budget(keep, sinks, recent)
    lo, hi = budget.region(n)
    idx = method.select(state, qd, k, n, budget)
    want = (n - (hi - lo)) + min(budget.top_k(n), hi - lo)
    assert idx.shape == (k.shape[0], want)
    for row in idx:
        assert row.unique().numel() == row.numel()
        assert int(row.min()) >= 0 and int(row.max()) < n
    if method.caps.estimator:
        out, read = method.attend(method.open(method.build(q, k, v)), qd, k, v, n, budget)
        assert out.shape == qd.shape and torch.isfinite(out).all()
        for row in read:
            assert int(row.min()) >= 0 and int(row.max()) < n
            assert set(range(lo)) | set(range(hi, n)) <= set(row.tolist())  # static keys read


@pytest.fixture(scope="module")
def tiny():
    return load_model("random:tiny")


@pytest.mark.parametrize("name", NAMES)
def test_keep_all_equals_dense_through_decoder(tiny, name):
    gen = torch.Generator().manual_seed(1)
    context = torch.randint(0, tiny.args.vocab_size, (150,), generator=gen)
    prompt = torch.randint(0, tiny.args.vocab_size, (5,), generator=gen).tolist()
    method = make_method(name, FULL.get(name))
    art = build_artifact(tiny, context, method, IndexerConfig(kv_dtype="float32", progress=False))
    config = SparseConfig(Budget(1.0, 4, 8))
    logits, attn, cache = start_batch(tiny, [art], [prompt], config, max_new_tokens=8)
    dense = tiny.model.new_cache(1, max_len=cache.max_len)
    ref = prefill(tiny.model, torch.cat([context, torch.tensor(prompt)])[None], dense, dense_attention)
    for _ in range(6):
        torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)
        tok = ref.argmax(-1)
        logits = decode_one_token(tiny.model, tok, cache, attn)
        ref = decode_one_token(tiny.model, tok, dense, dense_attention)
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)
    assert attn.keys_read > 0
