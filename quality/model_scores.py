"""Sparse decode through the whole model, scored against full attention.

teacher_forced: the continuation's true tokens are fed one step at a time with sparse attention,
and each step's prediction is compared with full attention (top-1 agreement, NLL).
passkey_accuracy: a random 5-digit key hidden at a random depth in filler text; the context
(cached, indexed) is the chat-template prefix, the instruction and the filler; the question
turn is decoded from the cache, as the service would. Same seeds for every method.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

import torch

from ctxcache.decoder import ReferenceSparseAttention, SparseConfig
from ctxcache.generation import SamplingParams, decode_n_tokens, decode_one_token, prefill
from ctxcache.methods import SparseMethod, Tables
from ctxcache.models.attention import dense_attention
from ctxcache.models.loader import LoadedModel

from ctxcache.quality.capture import Captured, build_tables, capture, context_cache

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
          "There and back again. ")
INSTRUCTION = ("There is an important pass key hidden inside a lot of irrelevant text. "
               "Find it and memorize it. I will quiz you about the pass key.\n\n")
QUESTION = "\n\nWhat is the pass key? Answer with the 5-digit number only."


@dataclass(frozen=True)
class PasskeyTrial:
    key: str
    context_ids: list[int]
    question_ids: list[int]


def make_trial(tokenizer, length: int, seed: int) -> PasskeyTrial:
    """A trial of about `length` tokens in total (context + question)."""
    rng = random.Random(seed)
    key = f"{rng.randint(10000, 99999)}"
    needle = f" The pass key is {key}. Remember it. {key} is the pass key. "
    head = tokenizer.apply_chat_template([{"role": "user", "content": "\x00"}], tokenize=False,
                                         add_generation_prompt=True)
    prefix, suffix = head.split("\x00")
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    question_ids = enc(QUESTION + suffix + "The pass key is")
    fixed = len(enc(prefix + INSTRUCTION)) + len(enc(needle)) + len(question_ids)
    reps = max(1, (length - fixed) // len(enc(FILLER)))
    depth = rng.randint(0, reps)
    body = FILLER * depth + needle + FILLER * (reps - depth)
    return PasskeyTrial(key, enc(prefix + INSTRUCTION + body), question_ids)


def _answer(lm: LoadedModel, cache, attn, question: list[int]) -> str:
    logits = prefill(lm.model, torch.tensor([question]), cache, attn)
    out = [int(t[0]) for t, _ in decode_n_tokens(lm.model, logits, cache, attn,
                                                  SamplingParams(max_tokens=8))]
    return lm.tokenizer.decode(out)


@torch.inference_mode()
def passkey_accuracy(lm: LoadedModel, methods: dict[str, SparseMethod | None], length: int,
                     trials: int, config: SparseConfig, seed: int = 1234) -> dict[str, float]:
    """Accuracy per method name (None = full attention) over the same `trials` prompts."""
    hits = {name: 0 for name in methods}
    for i in range(trials):
        trial = make_trial(lm.tokenizer, length, seed + i)
        cap = capture(lm, trial.context_ids, len(trial.context_ids))
        for name, method in methods.items():
            cache = context_cache(lm, cap, len(trial.question_ids) + 8)
            attn = dense_attention if method is None else ReferenceSparseAttention(
                method, [[method.open(t) for t in build_tables(method, cap)]], config)
            answer = _answer(lm, cache, attn, trial.question_ids)
            hits[name] += int(re.search(rf"\b{trial.key}\b", answer) is not None)
    return {name: h / trials for name, h in hits.items()}


@torch.inference_mode()
def teacher_forced(lm: LoadedModel, ids: list[int], cap: Captured, method: SparseMethod | None,
                   tables: list[Tables] | None, config: SparseConfig) -> dict[str, float]:
    """top1_agreement with full attention and mean NLL of the continuation's next tokens.

    method None runs full attention through the same step-by-step loop (a check that the loop
    itself reproduces the batched dense logits)."""
    n0, cont = cap.n_context, len(ids) - cap.n_context
    cache = context_cache(lm, cap, cont)
    if method is None:
        attn = dense_attention
    else:
        attn = ReferenceSparseAttention(method, [[method.open(t) for t in tables]], config)
    logits = torch.stack([decode_one_token(lm.model, torch.tensor([ids[n0 + t]]), cache, attn)[0]
                          for t in range(cont - 1)])  # row t predicts token n0 + t + 1
    target = torch.tensor(ids[n0 + 1:])
    ref = cap.logits[:cont - 1]
    nll = torch.nn.functional.cross_entropy(logits, target).item()
    ref_nll = torch.nn.functional.cross_entropy(ref, target).item()
    return {
        "top1_agreement": (logits.argmax(-1) == ref.argmax(-1)).float().mean().item(),
        "nll": nll,
        "nll_delta_pct": 100.0 * (nll - ref_nll) / ref_nll,
        "keys_read_frac_model": attn.keys_read / max(attn.keys_total, 1) if method else 1.0,
    }
