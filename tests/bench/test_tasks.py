"""The task suite is reproducible, sized by the tokenizer, and its scorer is RULER's."""

from __future__ import annotations

import pytest

from ctxcache.quality.tasks import KINDS, TaskSpec, match_all


@pytest.fixture(scope="module")
def tok(smollm2):
    return smollm2.tokenizer


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("n,filler", [(2048, "prose"), (4096, "code")])
def test_tasks_are_seeded_sized_and_hold_their_answers(tok, kind, n, filler):
    spec = TaskSpec(kind, n, filler)
    a, b, c = spec.make(tok, 0), spec.make(tok, 0), spec.make(tok, 1)
    assert a == b and a.context != c.context
    got = len(tok(a.context, add_special_tokens=False)["input_ids"])
    assert abs(got - n) <= 0.03 * n, got
    for answer in a.answers:
        assert answer in a.context
    assert a.score(" ".join(a.answers)) == 1.0 and a.score("nothing") == 0.0


def test_needle_order_and_common_word_counts(tok):
    vt = TaskSpec("vt", 1024).make(tok, 2)
    pos = [vt.context.index(f"VAR {name} =") for name in vt.answers]
    assert pos == sorted(pos)  # the chain reads in order
    cwe = TaskSpec("cwe", 1024).make(tok, 2)
    words = [w for w in cwe.context.split() if not w[:-1].isdigit()]
    assert all(words.count(w) == 30 for w in cwe.answers)


def test_scorer_and_spec_errors():
    assert match_all("The numbers are 1234 and 99", ("1234", "5678")) == 0.5
    with pytest.raises(ValueError, match="kind 'nope'"):
        TaskSpec("nope")
    with pytest.raises(ValueError, match="n_tokens=10"):
        TaskSpec("passkey", 10)
