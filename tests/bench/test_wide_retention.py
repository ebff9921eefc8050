"""The wide retention suite: its contexts hold every answer once at the stated depth, kinds,
depths and question kinds are balanced, and its per-kind / per-depth cells merge exactly."""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter

import pytest

from ctxcache.quality.texts import WIDE_KINDS
from ctxcache.quality.wide_tasks import STEP, WIDE_DEPTHS, WIDE_QKINDS, WideSpec, filler_lines
from ctxcache.bench.compare import config_of, merge, parse_args

N_TOKENS = 4096


@pytest.fixture(scope="module")
def tok():
    from ctxcache.models.loader import random_model_tokenizer
    t = random_model_tokenizer(49152)  # the bundled SmolLM2 tokenizer, without loading the model
    if t is None:
        pytest.skip("the SmolLM2 tokenizer is not installed")
    return t


@pytest.fixture(scope="module")
def contexts(tok):
    return {(k, s): WideSpec(N_TOKENS, k).make(tok, s) for k in WIDE_KINDS for s in (0, 1)}


def _whole(value: str) -> str:
    return rf"(?<![0-9A-Za-z]){re.escape(value)}(?![0-9A-Za-z])"


def test_contexts_are_seeded_sized_and_balanced(tok, contexts):
    for (kind, seed), ctx in contexts.items():
        assert ctx == WideSpec(N_TOKENS, kind).make(tok, seed)
        assert ctx.context != contexts[(kind, 1 - seed)].context
        got = len(tok(ctx.context, add_special_tokens=False)["input_ids"])
        assert abs(got - N_TOKENS) <= 0.03 * N_TOKENS, (kind, got)
        cells = Counter((q.kind, q.depth) for q in ctx.questions)
        assert cells == {(q, d): 1 for q in WIDE_QKINDS for d in WIDE_DEPTHS}, kind


def _body(ctx) -> str:
    start = ctx.context.index("The text below holds")
    return ctx.context[start:]


def _depth_of(lines: list[str], filler_at: list[int], at: int) -> float:
    """The fraction of the document's own lines before line `at`."""
    return sum(i < at for i in filler_at) / len(filler_at)


def test_every_needle_is_in_the_context_once_at_its_depth(contexts):
    for (kind, _), ctx in contexts.items():
        needles = [q for q in ctx.questions if q.kind != "doc"]
        body = _body(ctx)
        lines = body.split("\n")
        holders = {q.answers[0]: next(i for i, x in enumerate(lines) if re.search(_whole(q.answers[0]), x))
                   for q in needles}
        _, filler_at = filler_lines(body, {lines[i] for i in holders.values()})
        for q in needles:
            (value,) = q.answers
            assert len(re.findall(_whole(value), ctx.context)) == 1, (kind, q.kind, value)
            assert ctx.context.count(lines[holders[value]]) == 1
            assert abs(_depth_of(lines, filler_at, holders[value]) - q.depth) <= 4 * STEP, (kind, q.kind, q.depth)
            assert q.score(f" {value}.") == 1.0 and q.score(f" {value[:-1]}") == 0.0


def test_document_questions_quote_a_unique_line_near_their_depth(contexts):
    for (kind, _), ctx in contexts.items():
        _check_doc_questions(kind, ctx)


def test_every_kind_and_suite_seed_builds_at_4096(tok):
    """Git's maintenance release notes repeat earlier entries word for word: relnotes seed 7 at
    4096 tokens held one stretch twice, and no line near 25% depth had a unique opening."""
    for kind in WIDE_KINDS:
        for seed in range(20):
            ctx = WideSpec(N_TOKENS, kind).make(tok, seed)
            assert Counter((q.kind, q.depth) for q in ctx.questions) == {
                (q, d): 1 for q in WIDE_QKINDS for d in WIDE_DEPTHS}, (kind, seed)
    _check_doc_questions("relnotes", WideSpec(N_TOKENS, "relnotes").make(tok, 7))


def test_the_bundled_dpkg_log_is_the_generators_output():
    from ctxcache.quality.dpkglog_gen import dpkg_log
    from ctxcache.quality.texts import builtin_text
    log = dpkg_log()
    assert builtin_text("dpkglog") == log
    assert log == dpkg_log() and log != dpkg_log(seed=1)
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (startup|install|upgrade|configure|trigproc|status) \S.*",
                            x) for x in log.splitlines())


def _check_doc_questions(kind, ctx) -> None:
    body = _body(ctx)
    lines = body.split("\n")
    needle_lines = {x for x in lines if any(re.search(_whole(q.answers[0]), x)
                                            for q in ctx.questions if q.kind != "doc")}
    _, filler_at = filler_lines(body, needle_lines)
    for q in (q for q in ctx.questions if q.kind == "doc"):
        shown = q.question.split("The line reads: ", 1)[1].split()
        at = [i for i, x in enumerate(lines) if x.split()[:len(shown)] == shown]
        assert len(at) == 1, (kind, shown)  # its opening is the document's only one
        at = at[0]
        assert at in filler_at  # a line of the document, not a needle
        assert tuple(lines[at].split()[len(shown):len(shown) + 2]) == q.answers
        assert abs(_depth_of(lines, filler_at, at) - q.depth) <= 0.05, (kind, q.depth)


def test_the_wide_suite_defaults_and_refusals(capsys):
    args = parse_args(["--retention-suite", "wide", "--skip", "fid,task"])
    assert args.ret_fillers == list(WIDE_KINDS) and args.ret_lengths == [2048] and args.ret_seeds == list(range(20))
    assert config_of(args)["retention"]["suite"] == "wide"
    assert "suite" not in config_of(parse_args([]))["retention"]  # old bundled shards still merge
    assert parse_args(["--retention-suite", "wide", "--retention-seeds", "7"]).ret_seeds == [7]
    # a value equal to the bundled suite's default is still a value given
    assert parse_args(["--retention-suite", "wide", "--retention-seeds", "0,1,2"]).ret_seeds == [0, 1, 2]
    bundled = parse_args([])
    assert (bundled.ret_lengths, bundled.ret_seeds, len(bundled.ret_fillers)) == ([2048, 4096, 6144], [0, 1, 2], 6)
    for argv, why in ((["--retention-suite", "wide", "--retention-fillers", "prose"], "wide suite's kinds"),
                      (["--device", "cuda"], "add --skip fid")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert why in capsys.readouterr().err


def _ret(method, keep, kind, question, depth, score):
    return {"kind": "retention", "length": 4096, "filler": kind, "seed": 0, "question": question,
            "qkind": WIDE_QKINDS[question % len(WIDE_QKINDS)], "depth": depth, "method": method,
            "keep": keep, "score": score, "read_per_key": 50.0, "read_x_dense": 0.2}


def _cell_rows(kind: str, lost: set[int]) -> list[dict]:
    """Ten questions, two per depth: full and the oracle right on all, csattention losing `lost`."""
    qs = [(i, WIDE_DEPTHS[i // 2]) for i in range(10)]
    return ([_ret("full", None, kind, i, d, 1.0) for i, d in qs] + [_ret("oracle", 0.05, kind, i, d, 1.0) for i, d in qs]
            + [_ret("csattention", 0.05, kind, i, d, float(i not in lost)) for i, d in qs])


def test_per_kind_and_per_depth_cells_merge_across_shards(tmp_path):
    args = parse_args(["--retention-suite", "wide", "--skip", "fid,task", "--methods", "full,oracle,csattention",
                       "--retention-fillers", "relnotes,zones", "--retention-seeds", "0"])
    shards = tmp_path / "shards"
    shards.mkdir()
    for name, kind, lost in (("a", "relnotes", {0, 1, 9}), ("b", "zones", {1})):
        shard = {"bench": "compare", "config": config_of(args), "machine": {"cpu": "x"}, "commit": "c",
                 "date": "2026-11-28", "cells": {f"ret:4096:{kind}:0": {"rows": _cell_rows(kind, lost), "seconds": 1.0}}}
        if kind == "relnotes":  # a cell that records its own commit (a resumed shard holds several)
            shard["cells"][f"ret:4096:{kind}:0"]["commit"] = "a1"
        (shards / f"{name}.json").write_text(json.dumps(shard))
    paths = merge(argparse.Namespace(merge=str(shards), results=str(tmp_path / "out"), name=None))
    assert json.loads(paths["json"].read_text())["commit"] == ["a1", "c"]
    rows = json.loads(paths["json"].read_text())["rows"]
    cs = next(r for r in rows if r["method"] == "csattention")["retention"]
    assert (cs["full_correct"], cs["vs_oracle_losses"], cs["kept"]) == (20, 4, 16 / 20)
    assert cs["by_kind"]["relnotes"]["kept"] == 7 / 10 and cs["by_kind"]["zones"]["kept"] == 9 / 10
    assert cs["by_kind"]["relnotes"]["oracle_kept"] == 1.0
    depth = cs["by_depth"]  # questions 0, 1 sit at 5% and question 9 at 75%, over both kinds
    assert (depth["0.05"]["full_correct"], depth["0.05"]["vs_oracle_losses"]) == (4, 3)
    assert depth["0.75"]["kept"] == 3 / 4 and depth["0.25"]["kept"] == 1.0
    assert cs["by_kind_depth"]["zones"]["0.05"] == {"kept": 0.5, "full_correct": 2, "vs_oracle_wins": 0,
                                                     "vs_oracle_losses": 1}
    assert cs["by_qkind"]["number"]["full_correct"] == 4  # questions 0 and 5 of each kind
    md = paths["md"].read_text()
    assert "Wide suite, by needle depth" in md and "| csattention | 0.05 | 0.800 (20) 0/4 p=0.12 |" in md
    assert "| zones | 0.500 / 1.000 (2) 0/1 | 1.000 / 1.000 (2) 0/0 |" in md  # kind x depth
