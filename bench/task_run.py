"""Score sparse methods on the RULER-style tasks (bench/tasks.py) with the real decoder.

A context is prefilled once per (task, seed) with dense attention while capturing each layer's
post-RoPE queries; every method then builds its tables from that same Q/K/V (what the indexer
would build), so methods and budgets are compared on identical KV. `full` is dense attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ctxcache.artifact import ContextArtifact, LayerArtifact
from ctxcache.bench.tasks import Task, TaskSpec
from ctxcache.decoder.session import generate
from ctxcache.decoder.sparse_attention import SparseConfig
from ctxcache.generation import SamplingParams, prefill
from ctxcache.methods import Budget, SparseMethod, make_method
from ctxcache.models.attention import QueryCapture
from ctxcache.models.loader import LoadedModel

FULL = "full"


@dataclass
class Prefilled:
    """One dense prefill: tokens [N], last logits [V], per layer q [Hq, N, D] fp16, k, v [Hkv, N, D]."""

    tokens: torch.Tensor
    last_logits: torch.Tensor
    q: list[torch.Tensor]
    k: list[torch.Tensor]
    v: list[torch.Tensor]


@torch.inference_mode()
def prefill_context(lm: LoadedModel, tokens: list[int], chunk: int = 1024) -> Prefilled:
    ids = torch.as_tensor(tokens, dtype=torch.long)
    n, layers = ids.numel(), lm.args.n_layers
    cache = lm.model.new_cache(1, max_len=n)
    capture = QueryCapture(layers, dtype=torch.float16)
    logits = prefill(lm.model, ids[None], cache, capture, chunk)
    return Prefilled(ids, logits[0].float(), [capture.queries(i) for i in range(layers)],
                     [cache.k[i][0, :, :n].clone() for i in range(layers)],
                     [cache.v[i][0, :, :n].clone() for i in range(layers)])


def make_artifact(lm: LoadedModel, pre: Prefilled, method: SparseMethod,
                  kv_dtype: torch.dtype = torch.float16) -> ContextArtifact:
    """The artifact build_artifact would produce, from an existing prefill."""
    layers = []
    for i, (q, k, v) in enumerate(zip(pre.q, pre.k, pre.v)):
        tables = method.build_layer(q.float(), k, v, i, len(pre.q))
        layers.append(LayerArtifact(k=k.to(kv_dtype), v=v.to(kv_dtype), tables=tables))
    return ContextArtifact(
        model_id=lm.model_id, model_args=lm.args.to_dict(), method=method.name,
        method_params=method.params.to_dict(), tokens=pre.tokens, last_logits=pre.last_logits,
        layers=layers, kv_dtype=str(kv_dtype).removeprefix("torch."))


def answer(lm: LoadedModel, art: ContextArtifact, task: Task, config: SparseConfig) -> str:
    """Greedy answer to the task's question after the cached context."""
    tok = lm.tokenizer
    prompt = tok(task.question, add_special_tokens=False)["input_ids"]
    stops = tuple(x for x in (tok.eos_token_id,) if x is not None)
    sampling = SamplingParams(max_tokens=task.max_new_tokens, stop_token_ids=stops)
    out = [int(t[0]) for t, _ in generate(lm, [art], [prompt], sampling, config)]
    return tok.decode([t for t in out if t not in stops])


def _config(lm: LoadedModel, method_name: str, keep: float, sinks: int, recent: int) -> SparseConfig:
    if method_name == FULL:  # every layer dense: exact attention through the same decoder
        return SparseConfig(Budget(1.0, sinks, recent), dense_layers=tuple(range(lm.args.n_layers)))
    return SparseConfig(Budget(keep, sinks, recent))


def run_suite(lm: LoadedModel, methods: dict[str, tuple[str, dict]], specs: list[TaskSpec],
              keeps: list[float], seeds: list[int], sinks: int = 4, recent: int = 32,
              keeps_by_method: dict[str, list[float]] | None = None) -> list[dict]:
    """Score every (method label -> (name, params)) x spec x keep x seed; one prefill per
    (spec, seed) and one table build per method. -> rows {task, n_tokens, filler, method,
    keep, seed, score, output}; the method `full` is dense attention (its keep is ignored).
    keeps_by_method[label] replaces `keeps` for that label (e.g. one run of a method whose
    own parameters set its budget, like MagicPIG's (K, L))."""
    keeps_by_method = keeps_by_method or {}
    rows = []
    for spec in specs:
        for seed in seeds:
            task = spec.make(lm.tokenizer, seed)
            ids = lm.tokenizer(task.context, add_special_tokens=False)["input_ids"]
            total = len(ids) + len(lm.tokenizer(task.question, add_special_tokens=False)["input_ids"]) \
                + task.max_new_tokens
            if total > lm.args.max_seq_len:
                raise ValueError(f"{spec.kind} at n_tokens={spec.n_tokens}: context {len(ids)} + question "
                                 f"+ answer = {total} tokens exceeds the model's {lm.args.max_seq_len}")
            pre = prefill_context(lm, ids)
            for label, (name, params) in methods.items():
                method = make_method("oracle" if name == FULL else name, params)
                art = make_artifact(lm, pre, method)
                for keep in ([1.0] if name == FULL else keeps_by_method.get(label, keeps)):
                    out = answer(lm, art, task, _config(lm, name, keep, sinks, recent))
                    rows.append({"task": spec.kind, "n_tokens": int(pre.tokens.numel()),
                                 "filler": spec.filler, "method": label, "keep": keep, "seed": seed,
                                 "score": task.score(out), "output": out})
    return rows


def run_task(lm: LoadedModel, method_name: str, params: dict | None, task: TaskSpec,
             n_trials: int = 1, keep: float = 0.05, seeds: list[int] | None = None) -> float:
    """Mean score of one method on one task over n_trials seeds (seeds 0..n_trials-1 by default)."""
    seeds = list(seeds) if seeds is not None else list(range(n_trials))
    rows = run_suite(lm, {method_name: (method_name, params or {})}, [task], [keep], seeds)
    return sum(r["score"] for r in rows) / len(rows)
