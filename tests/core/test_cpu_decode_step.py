"""The faster CPU decode step (issue 50) computes what the old one did: the input-major weight
layout (models/cpu_layout.py) and the unmasked one-query attention (models/attention.py) against
the [out, in] weights and masked SDPA they replace, down to the greedy tokens of both modes."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from torch import nn

import ctxcache.decoder.reference_attention as reference_attention
from ctxcache.decoder import SparseConfig
from ctxcache.decoder.runner import ReferenceRunner
from ctxcache.indexer import IndexerConfig, build_artifact
from ctxcache.methods import make_method
from ctxcache.models.attention import causal_attention, one_query_attention
from ctxcache.models.cpu_layout import input_major


def test_one_query_attention_is_causal_attention() -> None:
    """One row's one query at the span's last position: what the masked SDPA computed, bitwise."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 6, 1, 16, generator=gen)
    cache_k, cache_v = torch.randn(2, 1, 2, 64, 16, generator=gen)  # a cache longer than the span
    k, v = cache_k[:, :, :37], cache_v[:, :, :37]
    assert torch.equal(one_query_attention(q, k, v), causal_attention(q, k, v, torch.tensor([[36]])))


def test_input_major_keeps_values_and_ties() -> None:
    lin = nn.Linear(8, 5)
    emb = nn.Embedding(5, 8)
    emb.weight = lin.weight  # tied, as SmolLM2's head and embedding are
    model = nn.ModuleDict({"lin": lin, "emb": emb})
    before = lin.weight.detach().clone()
    input_major(model)
    assert lin.weight.stride() == (1, 5) and emb.weight is lin.weight
    assert torch.equal(lin.weight, before)
    x = torch.randn(3, 8)
    torch.testing.assert_close(lin(x), x @ before.T + lin.bias)


def test_loaded_cpu_model_is_input_major(smollm2) -> None:
    linears = [m for m in smollm2.model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(m.weight.stride(0) == 1 for m in linears)


def _row_major(lm):
    old = copy.deepcopy(lm)
    for m in old.model.modules():
        if isinstance(m, nn.Linear):
            m.weight.data = m.weight.data.contiguous()
    return old


def _greedy(lm, art, prompt: list[int], config: SparseConfig, steps: int) -> tuple[list[int], torch.Tensor]:
    runner = ReferenceRunner(lm)
    row, first = runner.admit("c", art, prompt, config, steps + 1)
    tokens, logits = [int(first.argmax())], [first]
    for _ in range(steps):
        out = runner.step([row], [tokens[-1]])[0]
        tokens.append(int(out.argmax()))
        logits.append(out)
    return tokens, torch.stack(logits)


@pytest.mark.slow
def test_greedy_tokens_unchanged_in_both_modes(smollm2, monkeypatch) -> None:
    """SmolLM2, a 1K-token context, three questions, 24 greedy tokens in explicit sparse and
    dense: the same tokens as with the [out, in] weights and SDPA's decode attention (the step
    before issue 50), logits within 0.01 (fp32 sums in another order, through 30 layers)."""
    text = ("The licensee may copy and distribute verbatim copies of the Program's source code as "
            "received, in any medium, provided that each copy carries a notice. ") * 40
    tokens = smollm2.tokenizer.encode(text)[:1024]
    art = build_artifact(smollm2, tokens, make_method("csattention"), IndexerConfig(kv_dtype="float16", coded_kv=True))
    sparse = SparseConfig.from_schedule("0.05-step-1")
    dense = replace(sparse, dense_layers=tuple(range(smollm2.args.n_layers)))
    old_lm = _row_major(smollm2)
    questions = ["What may the licensee copy?", "Summarize the notice rule.", "Which medium is allowed?"]
    for question in questions:
        prompt = smollm2.tokenizer.encode(question)
        for config in (sparse, dense):
            new_tokens, new_logits = _greedy(smollm2, art, prompt, config, 24)
            with monkeypatch.context() as m:  # the old decode attention: SDPA with a mask
                m.setattr(reference_attention, "dense_attention",
                          lambda layer, q, cache, pos: causal_attention(
                              q, cache.k[layer][:, :, :int(pos.max()) + 1], cache.v[layer][:, :, :int(pos.max()) + 1], pos))
                old_tokens, old_logits = _greedy(old_lm, art, prompt, config, 24)
            assert new_tokens == old_tokens, (question, config.dense_layers[:1])
            torch.testing.assert_close(new_logits, old_logits, atol=1e-2, rtol=1e-3)
