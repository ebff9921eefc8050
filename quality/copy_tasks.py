"""Questions whose answers must be copied exactly from a long cached context.

One context (a real document as filler: one of quality/texts.py's KINDS, or `prose` /
`code`) holds many needles, and every needle is one question, so one prefill serves every
question (what a context cache is for). Per context, seeded:
- at each of DEPTHS (10 / 25 / 50 / 75 / 90%): a `number` (5 to 8 digits), a `ticket` number
  (5 to 7 digits, as bug and release numbers are written) and a `city`; each key word is
  distinct, so the other needles are the distractors of a lookup. (Codes like `K7Q-X29F` and
  uuids: SmolLM2 copied none of them with full attention at 4K, and a uuid's 40 answer tokens
  made every batch 40 steps long);
- `multikey`: four locker numbers of four people, one template (the keys are all that differs);
- `multivalue`: one key holding two serial numbers (at 30 and 70% depth), asked for both;
- `doc` questions: finish a line of the document itself (its next two words).
Needles are written the way the document would hold a note: a plain line in prose, a `#`
comment in Python, a `/* */` comment in C, a JSON record in JSON lines. The retention metric
counts only the questions full attention answers right.
Scoring is exact: a value counts only as a whole token of the output (41903 is not found in
"4190" nor in "419031"); a score is the fraction of a question's answers found.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass

from ctxcache.quality.tasks import _chat, haystack
from ctxcache.quality.texts import KINDS

DEPTHS = (0.1, 0.25, 0.5, 0.75, 0.9)
MULTI_DEPTHS = (0.3, 0.7)
LOCKER_DEPTHS = (0.2, 0.4, 0.6, 0.8)
FILLERS = ("prose", "code", *KINDS)
QKINDS = ("number", "ticket", "city", "multikey", "multivalue", "doc")
_HEADER = ("The text below hides reference numbers, ticket numbers and other facts among its "
           "lines. Memorize them exactly; you will be asked to copy them.\n")


@dataclass(frozen=True)
class Question:
    kind: str  # one of QKINDS
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
    doc_questions: int = 3

    def __post_init__(self) -> None:
        if self.n_tokens < 512:
            raise ValueError(f"n_tokens={self.n_tokens} must be >= 512")
        if self.filler not in FILLERS:
            raise ValueError(f"filler={self.filler!r} must be one of {FILLERS}")
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
PEOPLE = ("Maria", "Omar", "Ingrid", "Kenji", "Amara", "Tomas", "Priya", "Lukas", "Fatima", "Diego",
          "Elena", "Samuel", "Yuki", "Nadia", "Oscar", "Leila")
CITIES = ("Lisbon", "Nairobi", "Oslo", "Kyoto", "Denver", "Lima", "Dublin", "Hanoi", "Cairo", "Prague",
          "Seattle", "Manila", "Zurich", "Havana", "Perth", "Montreal", "Bogota", "Helsinki", "Tunis",
          "Osaka", "Glasgow", "Santiago", "Warsaw", "Mumbai", "Quito", "Vienna")


def _number(rng: random.Random, lo: int = 5, hi: int = 8) -> str:
    digits = rng.randint(lo, hi)
    return str(rng.randrange(10 ** (digits - 1), 10 ** digits))


def needle_line(filler: str, sentence: str) -> str:
    """A sentence written as the document would hold a note."""
    if filler in ("code", "python"):
        return f"# {sentence}"
    if filler == "c":
        return f"/* {sentence} */"
    if filler == "json":
        return json.dumps({"note": sentence})
    return sentence


# kind -> (what is asked, its value maker, answer tokens allowed)
_SINGLE = {
    "number": ("reference number of project {w}", _number, 14),
    "ticket": ("ticket number of the {w} release", lambda rng: _number(rng, 5, 7), 12),
}


def _single(rng: random.Random, word: str, kind: str, filler: str, depth: float,
            tokenizer, city: str) -> tuple[str, Question]:
    if kind == "city":
        _, q = _chat(tokenizer, "", f"In which city does the {word} team meet?", f"The {word} team meets in")
        return needle_line(filler, f"The {word} team meets in {city}."), Question(kind, depth, q, (city,), 8)
    what, make, limit = _SINGLE[kind]
    what, value = what.format(w=word), make(rng)
    _, q = _chat(tokenizer, "", f"What is the {what}?", f"The {what} is")
    return needle_line(filler, f"The {what} is {value}."), Question(kind, depth, q, (value,), limit)


def _lockers(rng: random.Random, filler: str, tokenizer) -> tuple[list[tuple[float, str]], list[Question]]:
    """One template, four keys: the lookup must tell the people apart."""
    placed, questions = [], []
    for depth, person in zip(LOCKER_DEPTHS, rng.sample(PEOPLE, len(LOCKER_DEPTHS))):
        value = _number(rng, 4, 6)
        placed.append((depth, needle_line(filler, f"The locker number of {person} is {value}.")))
        _, q = _chat(tokenizer, "", f"What is the locker number of {person}?", f"The locker number of {person} is")
        questions.append(Question("multikey", depth, q, (value,), 12))
    return placed, questions


def _multi(rng: random.Random, word: str, filler: str, tokenizer) -> tuple[list[str], Question]:
    values = (_number(rng), _number(rng))
    needles = [needle_line(filler, f"One of the two serial numbers of the {word} engine is {v}.") for v in values]
    _, q = _chat(tokenizer, "", f"What are the two serial numbers of the {word} engine?",
                 f"The two serial numbers of the {word} engine are")
    return needles, Question("multivalue", MULTI_DEPTHS[0], q, values, 28)


def _doc_questions(rng: random.Random, text: str, spec: CopySpec, needles: set[str], tokenizer) -> list[Question]:
    """Lines of the filler with >= 6 words, unique in the context, at seeded depths: the
    question quotes its first words, the answer is the next two."""
    lines = text.split("\n")
    ok = [i for i, x in enumerate(lines) if len(x.split()) >= 6 and x not in needles and text.count(x) == 1]
    out = []
    for _ in range(min(spec.doc_questions, len(ok))):
        target = rng.uniform(0.1, 0.9) * len(lines)
        i = min(ok, key=lambda j: abs(j - target))
        ok.remove(i)
        words = lines[i].split()
        cut = max(4, len(words) // 2)
        cut = min(cut, len(words) - 2)
        shown, answer = " ".join(words[:cut]), " ".join(words[cut:cut + 2])
        where = "code" if spec.filler in ("code", "python", "c") else "text"
        _, q = _chat(tokenizer, "", f"Copy the line of the {where} above that begins: {shown}",
                     f"The line reads: {shown}")
        out.append(Question("doc", i / len(lines), q, (answer,), 8))
    return out


def make_copy_context(tokenizer, spec: CopySpec, seed: int) -> CopyContext:
    rng = random.Random(seed * 7919 + spec.n_tokens + FILLERS.index(spec.filler))
    placed: list[tuple[float, str]] = []
    questions: list[Question] = []
    names = iter(rng.sample(NAMES, 3 * len(DEPTHS) + 1))
    cities = rng.sample(CITIES, len(DEPTHS))
    for i, depth in enumerate(DEPTHS):
        kinds = ("number", "city", "ticket")
        for j, kind in enumerate(kinds):  # 0.015 apart, not one block of needles
            needle, q = _single(rng, next(names), kind, spec.filler, depth, tokenizer, cities[i])
            placed.append((depth + 0.015 * j, needle))
            questions.append(q)
    lockers, asked = _lockers(rng, spec.filler, tokenizer)
    placed += lockers
    questions += asked
    multi, q = _multi(rng, next(names), spec.filler, tokenizer)
    placed += list(zip(MULTI_DEPTHS, multi))
    questions.append(q)
    placed.sort(key=lambda x: x[0])
    body = haystack(tokenizer, spec.n_tokens, [n for _, n in placed], seed, spec.filler, _HEADER,
                    depths=[d for d, _ in placed])
    questions += _doc_questions(rng, body, spec, {n for _, n in placed}, tokenizer)
    context, _ = _chat(tokenizer, body, "", "")
    return CopyContext(spec.n_tokens, spec.filler, seed, context, tuple(questions))
