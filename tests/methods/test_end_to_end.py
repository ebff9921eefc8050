"""Every method end to end on the default model: build_artifact -> generate on ~400 tokens
answers a passkey question (dense attention answers this seed correctly)."""

from __future__ import annotations

import pytest
import torch

from ctxcache.quality.tasks import TaskSpec
from ctxcache.decoder.session import generate
from ctxcache.decoder.reference_attention import SparseConfig
from ctxcache.generation import SamplingParams
from ctxcache.indexer.build import IndexerConfig, build_artifact
from ctxcache.methods import Budget, make_method

OURS = ["magicpig", "ctkvr", "prehoc", "multipole", "quest"]


@pytest.mark.parametrize("name", OURS)
def test_passkey_through_indexer_and_decoder(smollm2, name):
    torch.set_num_threads(1)  # shared 2-core machine: one thread is faster under contention
    tok = smollm2.tokenizer
    task = TaskSpec("passkey", n_tokens=400).make(tok, seed=0)
    ids = tok(task.context, add_special_tokens=False)["input_ids"]
    art = build_artifact(smollm2, ids, make_method(name), IndexerConfig(progress=False))
    prompt = tok(task.question, add_special_tokens=False)["input_ids"]
    sampling = SamplingParams(max_tokens=8, stop_token_ids=(tok.eos_token_id,))
    config = SparseConfig(Budget(0.2, 4, 16))  # the window alone cannot see the needle
    out = tok.decode([int(t[0]) for t, _ in generate(smollm2, [art], [prompt], sampling, config)])
    assert task.answers[0] in out, out
