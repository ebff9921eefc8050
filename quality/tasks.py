"""RULER-style long-context tasks, generated offline and reproducibly from a seed.

Each generator hides needles in real filler text (`prose` or `code`, see quality/texts.py) or
builds a word list, sized to a target number of context tokens measured with the model's
tokenizer, and returns a `Task`: the context (cached once, the part sparse methods index),
the question (the prompt decoded after it), the expected answers and a scorer. Task formats
follow RULER (Hsieh et al., 2024): passkey, niah_single, niah_multikey, niah_multivalue,
vt (variable tracking, one chain of 4 hops) and cwe (10 common words x 30, others x 3).
run_suite scores sparse methods on them with the real decoder: a context is prefilled once per
(task, seed) with dense attention while capturing each layer's post-RoPE queries; every method
then builds its tables from that same Q/K/V (what the indexer would build), so methods and
budgets are compared on identical KV. `full` is dense attention.
"""

from __future__ import annotations

import random
import re
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from ctxcache.artifact import ContextArtifact, LayerArtifact
from ctxcache.decoder.reference_attention import SparseConfig
from ctxcache.decoder.session import generate
from ctxcache.generation import SamplingParams, prefill
from ctxcache.methods import Budget, SparseMethod, make_method
from ctxcache.models.attention import QueryCapture
from ctxcache.models.loader import LoadedModel

from ctxcache.quality.texts import builtin_text

Scorer = Callable[[str, tuple[str, ...]], float]


def match_all(output: str, answers: tuple[str, ...]) -> float:
    """RULER's string_match_all: the fraction of expected answers found in the output."""
    low = output.lower()
    return sum(a.lower() in low for a in answers) / len(answers)


@dataclass(frozen=True)
class Task:
    kind: str
    context: str
    question: str
    answers: tuple[str, ...]
    max_new_tokens: int
    scorer: Scorer = field(default=match_all, compare=False)

    def score(self, output: str) -> float:
        return self.scorer(output, self.answers)


@dataclass(frozen=True)
class TaskSpec:
    """What to generate: a task kind at a context length (tokens) over a filler text."""

    kind: str
    n_tokens: int = 4096
    filler: str = "prose"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"task kind {self.kind!r} must be one of {sorted(KINDS)}")
        if self.n_tokens < 256:
            raise ValueError(f"n_tokens={self.n_tokens} must be >= 256")
        if self.filler not in ("prose", "code"):
            raise ValueError(f"filler={self.filler!r} must be 'prose' or 'code'")

    def make(self, tokenizer, seed: int) -> Task:
        return KINDS[self.kind](tokenizer, self.n_tokens, seed, self.filler)


def _count(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


@lru_cache(maxsize=8)
def _lines(tokenizer, filler: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    lines = tuple(x for x in builtin_text(filler).split("\n") if x.strip())
    return lines, tuple(_count(tokenizer, x + "\n") for x in lines)


def _chat(tokenizer, context_body: str, question: str, answer_prefix: str) -> tuple[str, str]:
    """Wrap as one user turn (chat template when the tokenizer has one); the context ends
    inside the user message, the question closes it and opens the answer."""
    head, tail = "", "\n"
    if getattr(tokenizer, "chat_template", None):
        marker = "\x00MARK\x00"
        text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False,
                                             add_generation_prompt=True)
        head, tail = text.split(marker)
    return head + context_body, f"\n\n{question}{tail}{answer_prefix}"


def haystack(tokenizer, n_tokens: int, needles: list[str], seed: int, filler: str,
             header: str, depths: list[float] | None = None) -> str:
    """Filler lines from a seeded offset (cycling), about n_tokens in all with header and needles,
    the needles at the given (or seeded random) depths, in order."""
    rng = random.Random(seed)
    lines, counts = _lines(tokenizer, filler)
    start = rng.randrange(len(lines))
    depths = sorted(depths if depths is not None else [rng.uniform(0.05, 0.95) for _ in needles])
    budget = n_tokens - _count(tokenizer, header) - sum(_count(tokenizer, x + "\n") for x in needles) - 40
    for _ in range(2):  # per-line counts miss merges across lines: measure once and correct
        i, got, body = start, 0, []
        while got < budget:
            body.append(lines[i % len(lines)])
            got += counts[i % len(lines)]
            i += 1
        for offset, (d, needle) in enumerate(zip(depths, needles)):
            body.insert(round(d * (len(body) - offset)) + offset, needle)
        text = header + "\n".join(body)
        budget = int(budget * (n_tokens - 40) / max(1, _count(tokenizer, text)))
    return text


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(6, 9)))


def _number(rng: random.Random, digits: int) -> str:
    return str(rng.randrange(10 ** (digits - 1), 10 ** digits))


_NIAH_HEADER = ("Some special magic numbers are hidden within the following text. Make sure to "
                "memorize it. I will quiz you about the numbers afterwards.\n")


def passkey(tokenizer, n_tokens: int, seed: int, filler: str) -> Task:
    rng = random.Random(seed)
    key = _number(rng, 5)
    header = ("There is an important info hidden inside a lot of irrelevant text. Find it and "
              "memorize it. I will quiz you about the important information there.\n")
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    ctx = haystack(tokenizer, n_tokens, [needle], seed, filler, header)
    c, q = _chat(tokenizer, ctx, "What is the pass key?", "The pass key is")
    return Task("passkey", c, q, (key,), 12)


def _niah(tokenizer, n_tokens: int, seed: int, filler: str, keys: int, values: int) -> tuple:
    rng = random.Random(seed)
    words = [_word(rng) for _ in range(keys)]
    numbers = [[_number(rng, 7) for _ in range(values)] for _ in words]
    needles = [f"One of the special magic numbers for {w} is: {x}." for w, xs in zip(words, numbers) for x in xs]
    rng.shuffle(needles)
    return words[0], tuple(numbers[0]), haystack(tokenizer, n_tokens, needles, seed, filler, _NIAH_HEADER)


def niah_single(tokenizer, n_tokens: int, seed: int, filler: str) -> Task:
    word, answers, ctx = _niah(tokenizer, n_tokens, seed, filler, 1, 1)
    c, q = _chat(tokenizer, ctx, f"What is the special magic number for {word} mentioned in the provided text?",
                 f"The special magic number for {word} mentioned in the provided text is")
    return Task("niah_single", c, q, answers, 16)


def niah_multikey(tokenizer, n_tokens: int, seed: int, filler: str) -> Task:
    word, answers, ctx = _niah(tokenizer, n_tokens, seed, filler, 4, 1)
    c, q = _chat(tokenizer, ctx, f"What is the special magic number for {word} mentioned in the provided text?",
                 f"The special magic number for {word} mentioned in the provided text is")
    return Task("niah_multikey", c, q, answers, 16)


def niah_multivalue(tokenizer, n_tokens: int, seed: int, filler: str) -> Task:
    word, answers, ctx = _niah(tokenizer, n_tokens, seed, filler, 1, 4)
    c, q = _chat(tokenizer, ctx, f"What are all the special magic numbers for {word} mentioned in the provided text?",
                 f"The special magic numbers for {word} mentioned in the provided text are")
    return Task("niah_multivalue", c, q, answers, 48)


def variable_tracking(tokenizer, n_tokens: int, seed: int, filler: str, hops: int = 4) -> Task:
    rng = random.Random(seed)
    names = ["".join(rng.choice(string.ascii_uppercase) for _ in range(5)) for _ in range(hops + 1)]
    value = _number(rng, 5)
    needles = [f"VAR {names[0]} = {value}"] + [f"VAR {b} = VAR {a}" for a, b in zip(names, names[1:])]
    header = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
    ctx = haystack(tokenizer, n_tokens, needles, seed, filler, header)
    c, q = _chat(tokenizer, ctx, f"Question: Find all variables that are assigned the value {value} in the text above.",
                 f"Answer: According to the chain(s) of variable assignment in the text above, {hops + 1} "
                 f"variables are assigned the value {value}, they are: ")
    return Task("vt", c, q, tuple(names), 40)


@lru_cache(maxsize=1)
def _vocabulary() -> tuple[str, ...]:
    text = builtin_text("prose") + builtin_text("code")
    return tuple(sorted(set(re.findall(r"\b[a-z]{4,12}\b", text))))


def common_words(tokenizer, n_tokens: int, seed: int, filler: str, n_common: int = 10,
                 freq_common: int = 30, freq_rare: int = 3) -> Task:
    """`filler` is unused: the context is RULER's numbered word list."""
    rng = random.Random(seed)
    vocab = list(_vocabulary())
    rng.shuffle(vocab)
    common, rare = vocab[:n_common], vocab[n_common:]
    header = ("Below is a numbered list of words. In these words, some appear more often than "
              "others. Memorize the ones that appear most often.\n")

    def listing(n_rare: int) -> str:
        words = common * freq_common + rare[:n_rare] * freq_rare
        random.Random(seed + 1).shuffle(words)
        return header + " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))

    n_rare = 0
    for _ in range(3):  # the list's token cost is near linear in its length: two corrections
        per_word = max(1.0, (_count(tokenizer, listing(n_rare + 50)) - _count(tokenizer, listing(n_rare))) / 150)
        n_rare = max(0, n_rare + int((n_tokens - 60 - _count(tokenizer, listing(n_rare))) / per_word / freq_rare))
    if n_rare > len(rare):
        raise ValueError(f"cwe at {n_tokens} tokens needs {n_rare} rare words; the vocabulary has {len(rare)}")
    c, q = _chat(tokenizer, listing(n_rare), f"Question: What are the {n_common} most common words in the above list?",
                 f"Answer: The top {n_common} words that appear most often in the list are:")
    return Task("cwe", c, q, tuple(common), 64)


KINDS: dict[str, Callable[..., Task]] = {
    "passkey": passkey, "niah_single": niah_single, "niah_multikey": niah_multikey,
    "niah_multivalue": niah_multivalue, "vt": variable_tracking, "cwe": common_words}


# ---------------------------------------------------------------- running the suite

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
    # the cache sits on the model's device (--device cuda); the tokens stay on the host
    logits = prefill(lm.model, ids[None].to(cache.lengths.device), cache, capture, chunk)
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
