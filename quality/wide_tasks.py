"""The wide retention suite: exact-copy questions in number-dense documents (issue 45).

Same contract as quality/copy_tasks.py (a CopyContext of Questions, one prefill serving
every question), over the WIDE_KINDS documents: release notes, Debian changelogs, tables
rendered as text (/etc/services, the time-zone tables) and a dpkg log. Per context, at each of
WIDE_DEPTHS (5 / 10 / 25 / 50 / 75%) one question of every WIDE_QKINDS:
- `number`, `version`, `name`: a needle in the document's own shape (wide_templates.py), each
  with its own key word;
- `multikey`: one template over five people, one per depth: the lookup must tell them apart;
- `doc`: finish a line of the document itself (its next two words, each must be copied; one
  where the line ends there).
So kinds, depths and question kinds are balanced by construction: 25 questions per context.
Every value is fresh: absent from the document and no substring of another value, so the
needle is the only place in the context that holds the answer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from ctxcache.quality.copy_tasks import NAMES, PEOPLE, CopyContext, Question
from ctxcache.quality.tasks import _chat, haystack
from ctxcache.quality.texts import WIDE_KINDS, builtin_text
from ctxcache.quality.wide_templates import SHAPES, TEMPLATES, Template

WIDE_DEPTHS = (0.05, 0.1, 0.25, 0.5, 0.75)
NEEDLE_QKINDS = ("number", "version", "name", "multikey")
WIDE_QKINDS = (*NEEDLE_QKINDS, "doc")
STEP = 0.01  # the needles of one depth sit this far apart, not as one block
DOC_REACH = 0.05  # a document question's line sits at most this far from its stated depth
_HEADER = ("The text below holds version numbers, port numbers, bug numbers, names and other facts "
           "among its lines. Memorize them exactly; you will be asked to copy them.\n")
_HAYSTACK_TRIES = 8
_RESEED = 100_003  # a retried haystack's seed offset: far from every suite seed
_AREAS = ("Europe", "America", "Asia", "Africa")


@dataclass(frozen=True)
class WideSpec:
    """A context of about n_tokens tokens over one of WIDE_KINDS, seeded (run_context's spec)."""

    n_tokens: int = 4096
    filler: str = "relnotes"

    def __post_init__(self) -> None:
        if self.n_tokens < 1024:
            raise ValueError(f"n_tokens={self.n_tokens} must be >= 1024")
        if self.filler not in WIDE_KINDS:
            raise ValueError(f"filler={self.filler!r} must be one of {WIDE_KINDS}")

    def make(self, tokenizer, seed: int) -> CopyContext:
        return make_wide_context(tokenizer, self, seed)


class _Fresh:
    """Values absent from the document and unrelated to every value drawn before."""

    def __init__(self, rng: random.Random, text: str) -> None:
        self.rng, self.low, self.used = rng, text.lower(), []

    def draw(self, shape: str) -> str:
        for _ in range(1000):
            v = SHAPES[shape](self.rng)
            if v.lower() not in self.low and not any(v in u or u in v for u in self.used):
                self.used.append(v)
                return v
        raise ValueError(f"no fresh {shape} value left for this document")

    def pick(self, pool: tuple[str, ...], n: int) -> list[str]:
        """n distinct words of pool that the document does not contain."""
        free = [w for w in pool if w.lower() not in self.low]
        if len(free) < n:
            raise ValueError(f"only {len(free)} of the key words are absent from the document")
        return self.rng.sample(free, n)


def _fill(t: Template, fresh: _Fresh, rng: random.Random, key: str, timestamps: list[str],
          d: int) -> tuple[str, dict]:
    """The template's fields for the needle at depth index d: the asked value and the line's other parts."""
    f = {"k": key, "kl": key.lower(), "p": key, "pl": key.lower(), "v": fresh.draw(t.shape),
         "n": t.nouns[d] if t.nouns else "",
         "cc": "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(2)), "area": rng.choice(_AREAS),
         "ts": rng.choice(timestamps) if timestamps else ""}
    if "{x}" in t.needle:
        f["x"] = fresh.draw("n4")
    if "{lat}" in t.needle:
        f["lat"] = fresh.draw("n4")
    return f["v"], f


def _timestamps(text: str) -> list[str]:
    """A log's own 'YYYY-MM-DD HH:MM:SS' stamps, so a needle's time is one the log has."""
    return [x[:19] for x in text.split("\n") if len(x) > 19 and x[4] == "-" and x[13] == ":"]


def _answer_limit(tokenizer, value: str) -> int:
    return min(24, len(tokenizer(" " + value, add_special_tokens=False)["input_ids"]) + 6)


def _needles(tokenizer, spec: WideSpec, fresh: _Fresh, rng: random.Random,
             text: str) -> tuple[list[tuple[float, str]], list[Question]]:
    """Every needle (its placement depth and line) and its question, depth by depth."""
    kinds = TEMPLATES[spec.filler]
    keys = iter(fresh.pick(NAMES, 3 * len(WIDE_DEPTHS)))
    people = fresh.pick(PEOPLE, len(WIDE_DEPTHS))
    stamps = _timestamps(text)
    placed, questions = [], []
    for d, depth in enumerate(WIDE_DEPTHS):
        for j, qkind in enumerate(NEEDLE_QKINDS):
            t = kinds[qkind]
            key = people[d] if qkind == "multikey" else next(keys)
            value, f = _fill(t, fresh, rng, key, stamps, d)
            placed.append((depth + STEP * j, t.needle.format(**f)))
            _, q = _chat(tokenizer, "", t.question.format(**f), t.prefix.format(**f))
            questions.append(Question(qkind, depth, q, (value,), _answer_limit(tokenizer, value)))
    return placed, questions


def _doc_question(tokenizer, lines: list[str], filler_at: list[int], depth: float, context: str,
                  skip: set[str], where: str) -> Question | None:
    """The document line nearest depth (+ the needles' middle offset) with an opening unique in
    the context: the question quotes its opening, the answers are the next two words. None if
    no line within DOC_REACH has one (a stretch the context holds twice)."""
    target = depth + 1.5 * STEP
    order = sorted(range(len(filler_at)), key=lambda r: abs(r / len(filler_at) - target))
    for rank in order:
        if abs(rank / len(filler_at) - depth) > DOC_REACH:
            continue
        line = lines[filler_at[rank]]
        cut = _unique_cut(line, context) if line not in skip else None
        if cut is None:
            continue
        # quoted with single spaces and no indent, as the bundled suite quotes its lines (the
        # context keeps the document's tabs and indents; the answers are whole words either way)
        words = line.split()
        shown = " ".join(words[:cut])
        _, q = _chat(tokenizer, "", f"Copy the line of the {where} above that begins: {shown}",
                     f"The line reads: {shown}")
        rest = line[_offset_of_word(line, cut):]
        limit = min(28, len(tokenizer(rest, add_special_tokens=False)["input_ids"]) + 4)
        return Question("doc", depth, q, tuple(words[cut:cut + 2]), limit)
    return None


def _unique_cut(line: str, context: str) -> int | None:
    """The fewest words (at least half the line, at least 2) that open line and nowhere else in
    the context, leaving one or two words of letters or digits to answer (a table row of three
    columns leaves one); None if there are none. Logs repeat their openings (one second, many
    packages): a longer cut finds the unique one."""
    words = line.split()
    for cut in range(max(2, len(words) // 2), len(words)):
        answers = words[cut:cut + 2]
        if not all(len(a) >= 2 and any(c.isalnum() for c in a) for a in answers):
            continue
        if context.count(line[:_offset_of_word(line, cut)].rstrip()) == 1:
            return cut
    return None


def _offset_of_word(line: str, n: int) -> int:
    """Character offset where the n-th whitespace-separated word of line begins."""
    i = 0
    for _ in range(n):
        while line[i].isspace():
            i += 1
        while not line[i].isspace():
            i += 1
    while line[i].isspace():
        i += 1
    return i


def filler_lines(body: str, needles: set[str]) -> tuple[list[str], list[int]]:
    """The body's lines and the indices of the document's own (not header, not needles)."""
    lines = body.split("\n")
    start = 1 if lines and _HEADER.startswith(lines[0]) else 0
    return lines, [i for i in range(start, len(lines)) if lines[i] not in needles and lines[i].strip()]


def _body_and_docs(tokenizer, spec: WideSpec, seed: int,
                   placed: list[tuple[float, str]]) -> tuple[str, list[Question]]:
    """The context and its document questions. Git's maintenance release notes repeat earlier
    releases' entries word for word, so a long context can hold one stretch twice and leave a
    depth without a line of unique opening: then the haystack starts elsewhere in the document
    (the needles stay). The first try is the only one a context that has its lines takes, so
    the contexts that never hit this (every 2048-token one of seeds 0-19) are unchanged."""
    needles = {n for _, n in placed}
    for attempt in range(_HAYSTACK_TRIES):
        body = haystack(tokenizer, spec.n_tokens, [n for _, n in placed], seed + _RESEED * attempt,
                        spec.filler, _HEADER, depths=[d for d, _ in placed])
        context, _ = _chat(tokenizer, body, "", "")
        lines, filler_at = filler_lines(body, needles)
        docs = [_doc_question(tokenizer, lines, filler_at, depth, context, needles, "text") for depth in WIDE_DEPTHS]
        if all(docs):
            return context, docs
    raise ValueError(f"{spec.filler} at {spec.n_tokens} tokens, seed {seed}: no document line with a unique "
                     f"opening within {DOC_REACH} of some depth in {_HAYSTACK_TRIES} haystacks")


def make_wide_context(tokenizer, spec: WideSpec, seed: int) -> CopyContext:
    rng = random.Random(seed * 7919 + spec.n_tokens + 100 + WIDE_KINDS.index(spec.filler))
    text = builtin_text(spec.filler)
    placed, questions = _needles(tokenizer, spec, _Fresh(rng, text), rng, text)
    context, docs = _body_and_docs(tokenizer, spec, seed, placed)
    # question order: depth by depth, each depth's needle kinds then its document line
    ordered = [q for d in WIDE_DEPTHS for q in [*(x for x in questions if x.depth == d),
                                                 *(x for x in docs if x.depth == d)]]
    return CopyContext(spec.n_tokens, spec.filler, seed, context, tuple(ordered))
