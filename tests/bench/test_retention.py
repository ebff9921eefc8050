"""Exact-copy contexts are seeded and sized; retention and its sign test count what they say."""

from __future__ import annotations

import pytest

from ctxcache.quality.copy_tasks import CopySpec, Question
from ctxcache.quality.retention import retention, sign_test_p


@pytest.fixture(scope="module")
def tok(smollm2):
    return smollm2.tokenizer


@pytest.mark.parametrize("n,filler", [(2048, "prose"), (4096, "python"), (2048, "changelog"), (2048, "c"),
                                      (2048, "json"), (2048, "narrative")])
def test_copy_contexts_are_seeded_sized_and_hold_their_answers(tok, n, filler):
    spec = CopySpec(n, filler)
    a, b, c = spec.make(tok, 0), spec.make(tok, 0), spec.make(tok, 1)
    assert a == b and a.context != c.context
    got = len(tok(a.context, add_special_tokens=False)["input_ids"])
    assert abs(got - n) <= 0.03 * n, got
    kinds = [q.kind for q in a.questions]
    counts = {k: kinds.count(k) for k in set(kinds)}
    assert counts == {"number": 5, "city": 5, "ticket": 5, "multikey": 4, "multivalue": 1, "doc": 3}
    for q in a.questions:
        for ans in q.answers:
            assert ans in a.context, (q.kind, ans)
        assert q.score(" and ".join(q.answers)) == 1.0
    note = {"python": "# The ticket number of", "c": "/* The ticket number of", "json": '{"note": "The ticket number of'}
    assert note.get(filler, "\nThe ticket number of") in a.context
    lines = a.context.split("\n")
    values = [v for q in a.questions if q.kind != "doc" for v in q.answers]
    start = next(i for i, x in enumerate(lines) if x.startswith("The text below hides")) + 1
    filler = [i for i, x in enumerate(lines) if i >= start and not any(v in x for v in values)]
    for q in a.questions:  # needles sit near their nominal depth among the document's lines
        if q.kind in ("number", "ticket", "city"):
            at = next(i for i, x in enumerate(lines) if q.answers[0] in x)
            assert abs(sum(i < at for i in filler) / len(filler) - q.depth) < 0.05  # + 0.015 j


def test_copies_must_be_exact():
    q = Question("number", 0.5, "", ("41903",), 8)
    assert q.score(" 41903.") == 1.0
    assert q.score(" 4190") == 0.0 and q.score(" 419031") == 0.0
    code = Question("code", 0.5, "", ("K7Q-X29F",), 8)
    assert code.score("is K7Q-X29F.") == 1.0 and code.score("is k7q-x29f") == 0.0
    multi = Question("multivalue", 0.3, "", ("123456", "98765"), 8)
    assert multi.score("123456 and 9876") == 0.5


def test_sign_test_matches_the_binomial():
    assert sign_test_p(0, 0) == 1.0
    assert sign_test_p(0, 5) == pytest.approx(2 / 32)
    assert sign_test_p(1, 12) == pytest.approx(2 * 14 / 2 ** 13)  # the 12 losses, 1 win: 0.003
    assert sign_test_p(5, 5) == 1.0


def _row(method, keep, question, score, depth=0.5):
    return {"kind": "retention", "length": 2048, "filler": "prose", "seed": 0, "question": question,
            "qkind": "number", "depth": depth, "method": method, "keep": keep, "score": score}


def test_retention_counts_only_what_full_gets_right_and_pairs_with_the_oracle():
    full = [1, 1, 1, 1, 0]
    oracle = [1, 1, 1, 0, 1]
    method = [1, 0, 0, 1, 1]
    rows = ([_row("full", None, i, s) for i, s in enumerate(full)]
            + [_row("oracle", 0.05, i, s) for i, s in enumerate(oracle)]
            + [_row("cs", 0.05, i, s) for i, s in enumerate(method)] + [_row("cs", 0.1, 0, 0)])
    got = retention(rows, "cs", 0.05)
    assert got["questions"] == 5 and got["full_correct"] == 4
    assert got["kept"] == pytest.approx(2 / 4)
    assert (got["vs_oracle_wins"], got["vs_oracle_losses"]) == (1, 2)  # q3 won, q1 and q2 lost
    assert retention(rows, "oracle", 0.05)["kept"] == pytest.approx(3 / 4)
    assert retention(rows, "cs", 0.05, where=lambda r: r["question"] < 2)["kept"] == pytest.approx(1 / 2)


def test_without_the_oracle_there_is_no_win_or_loss_to_report():
    """A run without the oracle has nothing to pair with: None, printed "-", not 0 / 0 p=1 (which
    read as "no answer lost against the oracle")."""
    from ctxcache.bench.common.compare_report import _cell, _retention_cells

    rows = [_row("full", None, i, 1) for i in range(3)] + [_row("cs", 0.05, i, s) for i, s in enumerate([1, 0, 1])]
    got = retention(rows, "cs", 0.05)
    assert got["kept"] == pytest.approx(2 / 3)
    assert (got["vs_oracle_wins"], got["vs_oracle_losses"], got["sign_test_p"]) == (None, None, None)
    assert _cell({"method": "cs"}, got) == "0.667 (3) -"
    assert _retention_cells({"method": "cs", "retention": got})[1:] == ["-", "-"]


def test_spec_errors_name_the_value():
    with pytest.raises(ValueError, match="n_tokens=100"):
        CopySpec(100)
    with pytest.raises(ValueError, match="filler='poem'.*narrative"):
        CopySpec(2048, "poem")


def test_methods_differing_only_in_search_share_one_build():
    from ctxcache.quality.retention import build_key
    assert build_key("csattention", {}) == build_key("csattention", {"rerank": 4.0})
    assert build_key("csattention", {}) != build_key("csattention", {"centroids": 256})
    assert build_key("full", {}) == build_key("oracle", {})  # full decodes densely over the oracle's artifact
