"""Dense prefill of the real model that keeps per-layer Q/K/V (and the continuation's logits):
what the fidelity measurements score, and the file of real Q/K/V + tables that `bench check`
carries to a GPU machine (which has no model)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ctxcache.generation import prefill
from ctxcache.methods import SparseMethod, Tables
from ctxcache.methods.csattention import CSAttention, CSAttentionParams
from ctxcache.models.attention import QueryCapture
from ctxcache.models.kv_cache import KVCache
from ctxcache.models.loader import DEFAULT_MODEL, LoadedModel, load_model

from ctxcache.quality.texts import builtin_text, tokens_of


@dataclass
class Captured:
    """q [Hq, T, D], k and v [Hkv, T, D] per layer for all T = context + continuation tokens;
    logits [C, V] of the continuation under full attention (row t predicts token ctx + t + 1)."""

    n_context: int
    q: list[torch.Tensor]
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    logits: torch.Tensor | None


@torch.inference_mode()
def capture(lm: LoadedModel, ids: list[int], n_context: int, chunk: int = 512) -> Captured:
    model, total = lm.model, len(ids)
    cache = model.new_cache(1, total)
    cap = QueryCapture(lm.args.n_layers)
    prefill(model, torch.tensor([ids[:n_context]]), cache, cap, chunk)
    logits = None
    if total > n_context:
        pos = torch.arange(n_context, total)[None]
        logits = model(torch.tensor([ids[n_context:]]), pos, cache, cap)[0]
        cache.lengths += total - n_context
    layers = range(lm.args.n_layers)
    return Captured(n_context, [cap.queries(l) for l in layers], [cache.k[l][0].clone() for l in layers],
                    [cache.v[l][0].clone() for l in layers], logits)


def build_tables(method: SparseMethod, cap: Captured) -> list[Tables]:
    """Index each layer from the context part of the capture."""
    n, layers = cap.n_context, len(cap.q)
    return [method.build_layer(q[:, :n], k[:, :n], v[:, :n], i, layers)
            for i, (q, k, v) in enumerate(zip(cap.q, cap.k, cap.v))]


def context_cache(lm: LoadedModel, cap: Captured, extra: int) -> KVCache:
    """A cache holding the captured context KV with room for `extra` more tokens."""
    n = cap.n_context
    cache = lm.model.new_cache(1, n + extra)
    cache.load_row(0, [k[:, :n] for k in cap.k], [v[:, :n] for v in cap.v])
    return cache


def check_capture(n_ctx: int, n_dec: int, layers: list[int], text: str = "prose") -> dict:
    """For `bench check`: Q/K/V of the default model over n_ctx + n_dec tokens of `text` and
    CSAttention tables (fp16) of `layers` from the first n_ctx; the last n_dec queries are the
    decode queries, each attending over the keys before and at its own position (torch.save it)."""
    lm = load_model(DEFAULT_MODEL)
    cap = capture(lm, tokens_of(lm.tokenizer, builtin_text(text), n_ctx + n_dec, text), n_ctx)
    method = CSAttention(CSAttentionParams(table_dtype="float16", rerank=1.0))  # int8: the check quantizes
    out = {"n_ctx": n_ctx, "layers": layers, "params": method.params.to_dict(), "data": []}
    for layer in layers:
        q, k, v = cap.q[layer], cap.k[layer], cap.v[layer]
        tables = method.build(q[:, :n_ctx], k[:, :n_ctx], v[:, :n_ctx])
        out["data"].append({"q_dec": q[:, n_ctx:].clone(), "k": k, "v": v, "tables": tables})
    return out
