"""Answer retention: of the questions full attention answers correctly, the fraction each
sparse method keeps; paired against the oracle (exact group top-K at the same budget).

One dense prefill per context (tasks.prefill_context) serves every method: each method builds
its tables from that prefill's Q/K/V (methods whose parameters change only the search share
one build), then answers all of the context's questions in one batched greedy decode.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from ctxcache.artifact import ContextArtifact
from ctxcache.decoder.reference_attention import SparseConfig
from ctxcache.decoder.session import Restorer, restore_on_demand, start_batch
from ctxcache.generation import SamplingParams, decode_n_tokens
from ctxcache.methods import make_method
from ctxcache.models.loader import LoadedModel

from ctxcache.quality.copy_tasks import CopyContext, CopySpec
from ctxcache.quality.step_bytes import step_bytes
from ctxcache.quality.tasks import FULL, _config, make_artifact, prefill_context

ORACLE = "oracle"


@torch.inference_mode()
def answer_all(lm: LoadedModel, art: ContextArtifact, ctx: CopyContext, config: SparseConfig) -> list[str]:
    """Greedy answers to every question of ctx after the cached context, in one batch."""
    tok = lm.tokenizer
    prompts = [tok(q.question, add_special_tokens=False)["input_ids"] for q in ctx.questions]
    stops = tuple(x for x in (tok.eos_token_id,) if x is not None)
    sampling = SamplingParams(max_tokens=max(q.max_new_tokens for q in ctx.questions), stop_token_ids=stops)
    outs: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    first, attn, cache = start_batch(lm, [art] * len(prompts), prompts, config, sampling.max_tokens,
                                     restore=_restore_once())
    for tokens, _ in decode_n_tokens(lm.model, first, cache, attn, sampling):
        for i, t in enumerate(tokens.tolist()):
            if done[i]:
                continue
            if t in stops:
                done[i] = True
                continue
            outs[i].append(int(t))
            # an answer is one line: stop a row at its first line break or its own token limit
            done[i] = len(outs[i]) >= ctx.questions[i].max_new_tokens or "\n" in tok.decode(outs[i][-1:])
        if all(done):  # every row answered: the rest of the batch's steps are not needed
            break
    return [tok.decode(o) for o in outs]


def _restore_once() -> Restorer:
    """Every row of a batch decodes the same artifact: restore its tables once and hand each
    row the same read-only tables (restoring per row held one fp64 copy of the keys per row)."""
    done: dict[int, list] = {}

    def restore(method, art, device, keys=None):
        if id(art) not in done:
            done[id(art)] = restore_on_demand(method, art, device, keys)
        return done[id(art)]
    return restore


def build_key(name: str, params: dict) -> str:
    """Artifacts differ only by the parameters that change the tables."""
    method = make_method(ORACLE if name == FULL else name, params)
    build = {k: v for k, v in method.params.to_dict().items() if k not in method.search_params}
    return json.dumps([method.name, build], sort_keys=True)


def run_context(lm: LoadedModel, methods: dict[str, tuple[str, dict]], spec: CopySpec, seed: int,
                keeps: list[float], sinks: int = 4, recent: int = 32) -> list[dict[str, Any]]:
    """Every method label -> (name, params) and keep on one seeded context -> one row per
    question; `full` (dense attention) decodes once."""
    ctx = spec.make(lm.tokenizer, seed)
    ids = lm.tokenizer(ctx.context, add_special_tokens=False)["input_ids"]
    pre = prefill_context(lm, ids)
    built: dict[str, ContextArtifact] = {}
    rows = []
    for label, (name, params) in methods.items():
        key = build_key(name, params)
        if key not in built:
            built[key] = make_artifact(lm, pre, make_method(ORACLE if name == FULL else name, params))
        art = built[key]
        if name != FULL:  # the artifact records the decoding method's own parameters
            art = replace(art, method_params=make_method(name, params).params.to_dict())
        for keep in [None] if name == FULL else keeps:
            config = _config(lm, name, keep or 1.0, sinks, recent)
            outs = answer_all(lm, art, ctx, config)
            a = lm.args
            read = step_bytes(name, params, len(ids), config.budget, a.n_kv_heads, a.n_heads // a.n_kv_heads,
                              a.head_dim)
            rows += [{"kind": "retention", "n_tokens": len(ids), "length": spec.n_tokens,
                      "filler": spec.filler, "seed": seed, "question": i, "qkind": q.kind,
                      "depth": round(q.depth, 3), "answers": list(q.answers), "method": label,
                      "keep": keep, "score": q.score(out), "output": out,
                      "read_per_key": read["per_key"], "read_x_dense": read["x_dense"]}
                     for i, (q, out) in enumerate(zip(ctx.questions, outs))]
    return rows


# ---------------------------------------------------------------- statistics

def sign_test_p(wins: int, losses: int) -> float:
    """Two-sided exact sign test (binomial, p = 1/2) on the discordant pairs; 1.0 when none."""
    n = wins + losses
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(wins, losses) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def retention(rows: list[dict], method: str, keep: float | None, reference: str = ORACLE,
              where: Callable[[dict], bool] = lambda r: True) -> dict[str, Any]:
    """Over the questions full attention answers correctly (and `where` admits): the fraction
    `method` answers correctly (kept), and its paired sign test against `reference` at the same
    keep (wins: questions it gets right and the reference not; None where the reference was not
    run on these questions: no pairs, nothing to count against)."""
    def correct(label: str, k: float | None) -> dict[tuple, bool]:
        return {(r["length"], r["filler"], r["seed"], r["question"]): r["score"] == 1.0
                for r in rows if r["kind"] == "retention" and r["method"] == label and r["keep"] == k
                and where(r)}
    full, mine, ref = correct(FULL, None), correct(method, keep), correct(reference, keep)
    asked = [q for q in full if q in mine]
    base = [q for q in asked if full[q]]
    paired = [q for q in base if q in ref]
    wins = sum(mine[q] and not ref[q] for q in paired) if paired else None
    losses = sum(ref[q] and not mine[q] for q in paired) if paired else None
    reads = [(r["read_per_key"], r["read_x_dense"]) for r in rows if r["kind"] == "retention"
             and r["method"] == method and r["keep"] == keep and where(r) and "read_per_key" in r]
    return {"questions": len(asked), "full_correct": len(base),
            "read_per_key": sum(x for x, _ in reads) / len(reads) if reads else None,
            "read_x_dense": sum(x for _, x in reads) / len(reads) if reads else None,
            "kept": sum(mine[q] for q in base) / len(base) if base else None,
            "vs_oracle_wins": wins, "vs_oracle_losses": losses,
            "sign_test_p": sign_test_p(wins, losses) if paired else None}
