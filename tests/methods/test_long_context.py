"""The real model at long context (slow: deselected by default, `pytest -m slow` runs it):
SmolLM2 indexes a 4K-token haystack with CSAttention and, reading 10% of the keys, retrieves
the needle (what bench/fidelity measures over many seeds, here one seed as a regression check)."""

from __future__ import annotations

import pytest
import torch

from ctxcache.quality.tasks import TaskSpec
from ctxcache.decoder.reference_attention import SparseConfig
from ctxcache.decoder.session import generate
from ctxcache.generation import SamplingParams
from ctxcache.indexer.build import IndexerConfig, build_artifact
from ctxcache.methods import Budget, make_method

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", ["csattention", "oracle"])
def test_needle_at_4k_tokens_through_indexer_and_decoder(smollm2, name):
    tok = smollm2.tokenizer
    task = TaskSpec("niah_single", n_tokens=4096).make(tok, seed=0)
    ids = tok(task.context, add_special_tokens=False)["input_ids"]
    assert len(ids) > 3500
    art = build_artifact(smollm2, ids, make_method(name), IndexerConfig(progress=False))
    prompt = tok(task.question, add_special_tokens=False)["input_ids"]
    sampling = SamplingParams(max_tokens=12, stop_token_ids=(tok.eos_token_id,))
    config = SparseConfig(Budget(0.1, 4, 64))  # the window alone cannot see the needle
    torch.manual_seed(0)
    out = tok.decode([int(t[0]) for t, _ in generate(smollm2, [art], [prompt], sampling, config)])
    assert task.score(out) == 1.0, out
