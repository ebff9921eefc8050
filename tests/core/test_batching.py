"""Continuous batching: streams stepped together decode exactly what each decodes alone."""

import threading
import time

import pytest
import torch

from ctxcache.decoder import SparseConfig, generate
from ctxcache.decoder.engine import Engine, Sequence
from ctxcache.decoder.runner import ReferenceRunner
from ctxcache.decoder.scheduler import StopRule
from ctxcache.generation import SamplingParams
from ctxcache.indexer import IndexerConfig, build_artifact
from ctxcache.methods import Budget, make_method
from ctxcache.models.loader import load_model

QUIET = IndexerConfig(progress=False, kv_dtype="float32")
CONFIG = SparseConfig(Budget(0.1, 2, 8))


@pytest.fixture(scope="module")
def tiny():
    return load_model("random:tiny")


@pytest.fixture(scope="module")
def artifacts(tiny):
    method = make_method("csattention", {"subspaces": 4, "centroids": 16})
    return [build_artifact(tiny, _tokens(tiny, n, seed), method, QUIET)
            for n, seed in ((300, 1), (170, 2), (90, 3), (240, 4))]


def _tokens(lm, n, seed):
    return torch.randint(0, lm.args.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _alone(lm, art, prompt, sampling):
    return [int(t[0]) for t, _ in generate(lm, [art], [prompt], sampling, CONFIG)]


def _start(lm, batcher, art, prompt, sampling):
    return batcher.start("ctx", art, prompt, CONFIG, sampling)


def _never():
    return None


def test_batched_streams_equal_each_alone(tiny, artifacts):
    # different contexts, lengths and token budgets; seeded sampling in one of them
    samplings = [SamplingParams(max_tokens=9), SamplingParams(max_tokens=4),
                 SamplingParams(max_tokens=12, temperature=0.8, seed=5), SamplingParams(max_tokens=7)]
    prompts = [_tokens(tiny, 3 + i, 10 + i) for i in range(4)]
    expected = [_alone(tiny, a, p, s) for a, p, s in zip(artifacts, prompts, samplings)]
    batcher = Engine(ReferenceRunner(tiny), max_batch=3)  # 4 streams > max_batch: rows take turns
    try:
        seqs = [_start(tiny, batcher, a, p, s) for a, p, s in zip(artifacts, prompts, samplings)]
        got = [[t for t, _ in s.tokens(_never)] for s in seqs]
    finally:
        batcher.close()
    assert got == expected
    assert batcher.rows_stepped > batcher.steps  # some steps really held several rows


def test_streams_joining_from_threads(tiny, artifacts):
    sampling = SamplingParams(max_tokens=10)
    prompts = [_tokens(tiny, 4, 20 + i) for i in range(4)]
    expected = [_alone(tiny, a, p, sampling) for a, p in zip(artifacts, prompts)]
    batcher, got = Engine(ReferenceRunner(tiny)), [None] * 4

    def one(i):
        got[i] = [t for t, _ in _start(tiny, batcher, artifacts[i], prompts[i], sampling).tokens(_never)]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        batcher.close()
    assert got == expected


def test_cancel_leaves_other_streams_intact(tiny, artifacts):
    sampling = SamplingParams(max_tokens=8)
    prompts = [_tokens(tiny, 3, 30), _tokens(tiny, 3, 31)]
    expected = _alone(tiny, artifacts[1], prompts[1], sampling)
    batcher = Engine(ReferenceRunner(tiny))
    try:
        a = _start(tiny, batcher, artifacts[0], prompts[0], sampling)
        b = _start(tiny, batcher, artifacts[1], prompts[1], sampling)
        for i, _ in enumerate(a.tokens(_never)):
            if i == 1:
                break  # leaving the loop cancels stream a
        assert a.cancelled.is_set()
        assert [t for t, _ in b.tokens(_never)] == expected
    finally:
        batcher.close()


def test_check_runs_while_waiting_and_closed_batcher_refuses(tiny, artifacts):
    class Stop(Exception):
        pass

    def stop():
        raise Stop

    # a sequence no batcher steps: its consumer must be released by the check, not hang
    idle = Sequence(None, "reference", SamplingParams(max_tokens=4), StopRule(4), 7, False, False)
    tokens = idle.tokens(stop, poll_s=0.01)
    assert next(tokens) == (7, False)
    with pytest.raises(Stop):
        next(tokens)
    assert idle.cancelled.is_set()
    batcher = Engine(ReferenceRunner(tiny))
    batcher.close()
    with pytest.raises(RuntimeError, match="closed"):
        batcher.start("ctx", artifacts[2], [5], CONFIG, SamplingParams(max_tokens=4))


def test_max_batch_validated(tiny):
    with pytest.raises(ValueError, match="max_batch"):
        Engine(ReferenceRunner(tiny), max_batch=0)


def test_a_broken_release_fails_the_other_streams_instead_of_hanging(tiny, artifacts):
    class BrokenRelease(ReferenceRunner):
        def release(self, row):
            raise RuntimeError("release failed")

    batcher = Engine(BrokenRelease(tiny))
    sampling = SamplingParams(max_tokens=50)
    try:
        a = _start(tiny, batcher, artifacts[0], _tokens(tiny, 3, 40), sampling)
        b = _start(tiny, batcher, artifacts[1], _tokens(tiny, 3, 41), sampling)
        a.cancel()  # the engine releases a's row before its next step: that release raises
        started = time.monotonic()

        def deadline():
            assert time.monotonic() - started < 30, "b's consumer hung on a dead engine"

        with pytest.raises(RuntimeError, match="engine stopped"):
            for _ in b.tokens(deadline):
                pass
        with pytest.raises(RuntimeError, match="closed"):
            _start(tiny, batcher, artifacts[2], [5], sampling)
    finally:
        batcher.close()


def test_streams_of_a_context_share_its_restored_tables(tiny, artifacts) -> None:
    """The reference runner restores a context once for all its streams (read-only tables);
    a new artifact object for the id restores anew, and evict drops the shared copy. The
    shared tables decode what freshly restored ones decode."""
    runner = ReferenceRunner(tiny)
    art = artifacts[0]
    prompt = _tokens(tiny, 5, 9)
    a, first_a = runner.admit("c0", art, prompt, CONFIG, 8)
    b, first_b = runner.admit("c0", art, prompt, CONFIG, 8)
    tables = lambda row: [s.tables for s in row.attn.states[0]]  # noqa: E731
    assert all(x is y for x, y in zip(tables(a), tables(b)))
    assert torch.equal(first_a, first_b)
    steps = [runner.step([a, b], [3, 3]) for _ in range(3)]
    assert all(torch.equal(s[0], s[1]) for s in steps)  # rows with the same input, shared tables
    again = type(art)(**{f: getattr(art, f) for f in art.__dataclass_fields__})  # a reload: a new object
    c, _ = runner.admit("c0", again, prompt, CONFIG, 8)
    assert not any(x is y for x, y in zip(tables(a), tables(c)))
    assert runner.evict("c0") and not runner.evict("c0")
    alone = _alone(tiny, art, prompt, SamplingParams(max_tokens=4))
    d, first_d = runner.admit("c0", art, prompt, CONFIG, 8)
    got = [int(first_d.argmax())]
    for _ in range(3):
        got.append(int(runner.step([d], [got[-1]])[0].argmax()))
    assert got == alone
