"""Questions whose answers must be copied exactly from a long cached context.

One context (real filler text: `prose` or `code`, bench/common/texts.py) holds many needles, and
every needle is one question, so one prefill serves every question (what a context cache is
for). Per context, seeded:
- `per_depth` `number` and `code` needles each (5 to 8 digits; codes like `K7Q-X29F`) at 10,
  50 and 90% depth,
  in prose sentences or, in code filler, as `#` comments; each key word is distinct, so the
  other needles are the distractors of a multi-key lookup;
- one multi-value key holding two numbers (at 30 and 70% depth), asked for both;
- `doc` questions: finish a line of the filler itself (its next two words), i.e. a question
  about the document; the retention metric counts only those full attention gets right.
Scoring is exact: a number or code counts only as a whole token of the output (41903 is not
found in "4190" nor in "419031"); a score is the fraction of a question's answers found.
"""

from __future__ import annotations

import random
import re
import string
from dataclasses import dataclass

from ctxcache.bench.common.tasks import _chat, haystack

DEPTHS = (0.1, 0.5, 0.9)
MULTI_DEPTHS = (0.3, 0.7)
FILLERS = ("prose", "code")
_HEADER = ("The text below hides access codes and reference numbers among other material. "
           "Memorize them exactly; you will be asked to copy them.\n")


@dataclass(frozen=True)
class Question:
    kind: str  # number | code | multivalue | doc
    depth: float  # where its needle (or line) sits in the context, 0..1
    question: str  # the prompt decoded after the cached context
    answers: tuple[str, ...]
    max_new_tokens: int

    def score(self, output: str) -> float:
        """Fraction of answers found in the output exactly (whole tokens; doc: case-insensitive)."""
        if self.kind == "doc":
            return sum(a.lower() in output.lower() for a in self.answers) / len(self.answers)
        return sum(bool(re.search(rf"(?<![0-9A-Za-z]){re.escape(a)}(?![0-9A-Za-z])", output))
                   for a in self.answers) / len(self.answers)


@dataclass(frozen=True)
class CopyContext:
    n_tokens: int
    filler: str
    seed: int
    context: str
    questions: tuple[Question, ...]


@dataclass(frozen=True)
class CopySpec:
    """A context of about n_tokens tokens over a filler text, seeded; doc_questions per context."""

    n_tokens: int = 4096
    filler: str = "prose"
    doc_questions: int = 1
    per_depth: int = 2  # number and code needles per (kind, depth)

    def __post_init__(self) -> None:
        if self.n_tokens < 512:
            raise ValueError(f"n_tokens={self.n_tokens} must be >= 512")
        if self.filler not in FILLERS:
            raise ValueError(f"filler={self.filler!r} must be one of {FILLERS}")
        if not 1 <= self.per_depth <= 4:
            raise ValueError(f"per_depth={self.per_depth} must be in [1, 4]")
        if self.doc_questions < 0:
            raise ValueError(f"doc_questions={self.doc_questions} must be >= 0")

    def make(self, tokenizer, seed: int) -> CopyContext:
        return make_copy_context(tokenizer, self, seed)


# keys are distinct real names: random letter strings look alike to a 135M model, and full
# attention then confuses the keys themselves, which is not what this suite measures
NAMES = ("Falcon", "Harbor", "Orchid", "Granite", "Juniper", "Lantern", "Meadow", "Nimbus", "Quartz",
         "Saffron", "Thistle", "Willow", "Beacon", "Cobalt", "Dynamo", "Ember", "Glacier", "Hazel",
         "Indigo", "Jasper", "Kestrel", "Lotus", "Marble", "Nectar", "Onyx", "Pepper", "Raven", "Sierra",
         "Tundra", "Velvet", "Walnut", "Zephyr", "Acorn", "Bramble", "Cedar", "Delta", "Fennel", "Garnet")


def _number(rng: random.Random) -> str:
    digits = rng.randint(5, 8)
    return str(rng.randrange(10 ** (digits - 1), 10 ** digits))


def _code(rng: random.Random) -> str:
    chars = string.ascii_uppercase + string.digits
    return "".join(rng.choice(chars) for _ in range(3)) + "-" + "".join(rng.choice(chars) for _ in range(4))


def _needle(filler: str, sentence: str) -> str:
    return f"# {sentence}" if filler == "code" else sentence


def _single(rng: random.Random, word: str, kind: str, filler: str, depth: float,
            tokenizer) -> tuple[str, Question]:
    if kind == "number":
        value, what = _number(rng), f"reference number of project {word}"
    else:
        value, what = _code(rng), f"access code for the {word} door"
    _, q = _chat(tokenizer, "", f"What is the {what}?", f"The {what} is")
    return _needle(filler, f"The {what} is {value}."), Question(kind, depth, q, (value,), 14)


def _multi(rng: random.Random, word: str, filler: str, tokenizer) -> tuple[list[str], Question]:
    values = (_number(rng), _number(rng))
    needles = [_needle(filler, f"One of the two serial numbers of the {word} engine is {v}.") for v in values]
    _, q = _chat(tokenizer, "", f"What are the two serial numbers of the {word} engine?",
                 f"The two serial numbers of the {word} engine are")
    return needles, Question("multivalue", MULTI_DEPTHS[0], q, values, 28)


def _doc_questions(rng: random.Random, text: str, spec: CopySpec, needles: set[str], tokenizer) -> list[Question]:
    """Lines of the filler with >= 6 words, unique in the context, at seeded depths: the
    question quotes its first words, the answer is the next two."""
    lines = text.split("\n")
    ok = [i for i, x in enumerate(lines) if len(x.split()) >= 6 and x not in needles and text.count(x) == 1]
    out = []
    for _ in range(spec.doc_questions):
        target = rng.uniform(0.1, 0.9) * len(lines)
        i = min(ok, key=lambda j: abs(j - target))
        ok.remove(i)
        words = lines[i].split()
        cut = max(4, len(words) // 2)
        cut = min(cut, len(words) - 2)
        shown, answer = " ".join(words[:cut]), " ".join(words[cut:cut + 2])
        where = "code" if spec.filler == "code" else "text"
        _, q = _chat(tokenizer, "", f"Copy the line of the {where} above that begins: {shown}",
                     f"The line reads: {shown}")
        out.append(Question("doc", i / len(lines), q, (answer,), 8))
    return out


def make_copy_context(tokenizer, spec: CopySpec, seed: int) -> CopyContext:
    rng = random.Random(seed * 7919 + spec.n_tokens + (spec.filler == "code"))
    placed: list[tuple[float, str]] = []
    questions: list[Question] = []
    names = iter(rng.sample(NAMES, 2 * spec.per_depth * len(DEPTHS) + 1))
    for depth in DEPTHS:
        for j in range(2 * spec.per_depth):  # 0.015 apart, not one block of needles
            kind = ("number", "code")[j % 2]
            needle, q = _single(rng, next(names), kind, spec.filler, depth, tokenizer)
            placed.append((depth + 0.015 * j, needle))
            questions.append(q)
    multi, q = _multi(rng, next(names), spec.filler, tokenizer)
    placed += list(zip(MULTI_DEPTHS, multi))
    questions.append(q)
    placed.sort(key=lambda x: x[0])
    body = haystack(tokenizer, spec.n_tokens, [n for _, n in placed], seed, spec.filler, _HEADER,
                    depths=[d for d, _ in placed])
    questions += _doc_questions(rng, body, spec, {n for _, n in placed}, tokenizer)
    context, _ = _chat(tokenizer, body, "", "")
    return CopyContext(spec.n_tokens, spec.filler, seed, context, tuple(questions))
