"""Admission on the engine thread: a prompt's prefill goes a chunk per decode step beside the
streams decoding, and a caller that leaves, a prefill that fails or an engine that closes
releases the row exactly once (a fake runner logs what ran in which order; no model)."""

import threading
import time

import pytest
import torch

from ctxcache.decoder.engine import Engine
from ctxcache.decoder.reference_attention import SparseConfig
from ctxcache.generation import SamplingParams
from ctxcache.methods import Budget

CONFIG = SparseConfig(Budget(0.1, 2, 8))
LOGITS = torch.tensor([0.0, 1.0, 0.0])  # greedy token 1, never a stop token


class ChunkedRunner:
    """Rows are context ids; a prompt's prefill is `chunks` chunks; a step takes `step_s`."""

    name = "fake"

    def __init__(self, chunks: int = 4, step_s: float = 0.002, fail: set[str] = frozenset()) -> None:
        self.chunks, self.step_s, self.fail = chunks, step_s, fail
        self.log: list[tuple] = []
        self.released: list[str] = []
        self._lock = threading.Lock()

    def begin(self, cid, art, prompt, config, max_new, check):
        def run():
            for i in range(self.chunks):
                with self._lock:
                    self.log.append(("chunk", cid, i))
                if cid in self.fail and i == 1:
                    raise RuntimeError(f"prefill of {cid} broke")
                time.sleep(self.step_s)
                yield LOGITS if i == self.chunks - 1 else None
        return cid, run()

    def step(self, rows, tokens):
        with self._lock:
            self.log.append(("step", tuple(rows)))
        time.sleep(self.step_s)
        return LOGITS.expand(len(rows), -1)

    def cache_full(self, row) -> bool:
        return False

    def release(self, row) -> None:
        with self._lock:
            self.released.append(row)


def _start(engine, cid, max_tokens=10_000, check=lambda: None):
    return engine.start(cid, None, [1, 2, 3], CONFIG, SamplingParams(max_tokens=max_tokens), check)


def _decoding(engine, cid, read=1):
    """A stream started and `read` of its tokens consumed (the prefill's, then steps'); -> it
    and its token iterator."""
    seq = _start(engine, cid)
    tokens = seq.tokens(lambda: None)
    for _ in range(read):
        next(tokens)
    return seq, tokens


def _wait_for(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_a_prefill_goes_a_chunk_per_step_beside_decoding_streams():
    runner = ChunkedRunner(chunks=4)
    engine = Engine(runner)
    try:
        a, tokens_a = _decoding(engine, "a")
        b = _start(engine, "b", max_tokens=2)
        assert [t for t, _ in b.tokens(lambda: None)] == [1, 1]
        a.cancel()
    finally:
        engine.close()
    log = runner.log
    a_chunks = [i for i, e in enumerate(log) if e[:2] == ("chunk", "a")]
    b_chunks = [i for i, e in enumerate(log) if e[:2] == ("chunk", "b")]
    assert a_chunks == [0, 1, 2, 3]  # nothing decoded yet: the whole prefill at once
    assert len(b_chunks) == 4
    for lo, hi in zip(b_chunks, b_chunks[1:]):  # a decoded between every two chunks of b's prefill
        assert any(e[0] == "step" and "a" in e[1] for e in log[lo:hi]), log[lo:hi + 1]


class GatedRunner(ChunkedRunner):
    """Its steps wait for `gate` once they are logged: a test holds one while streams arrive."""

    def __init__(self, chunks: int, step_s: float) -> None:
        super().__init__(chunks=chunks, step_s=step_s)
        self.gate = threading.Event()
        self.gate.set()

    def step(self, rows, tokens):
        with self._lock:
            self.log.append(("step", tuple(rows)))
        self.gate.wait()
        time.sleep(self.step_s)
        return LOGITS.expand(len(rows), -1)


def test_a_burst_runs_whole_prefills_while_more_wait_than_decode():
    """Three join one decoding stream within a step: the two oldest prefills run whole, back to
    back (more wait than decode), the third a chunk per step beside the three decoding."""
    runner = GatedRunner(chunks=4, step_s=0.02)
    engine = Engine(runner)
    try:
        a, _ = _decoding(engine, "a")
        runner.gate.clear()
        steps = sum(e[0] == "step" for e in runner.log)
        _wait_for(lambda: sum(e[0] == "step" for e in runner.log) > steps)  # a step holds the engine
        joiners = [threading.Thread(target=lambda c=c: list(_start(engine, c, max_tokens=2).tokens(lambda: None)))
                   for c in "bcd"]
        for t in joiners:
            t.start()
        _wait_for(lambda: len(engine._admissions) == 3)
        runner.gate.set()
        for t in joiners:
            t.join(timeout=10)
        a.cancel()
    finally:
        engine.close()
    log = runner.log
    chunks = {c: [i for i, e in enumerate(log) if e[:2] == ("chunk", c)] for c in "bcd"}
    assert chunks["b"] == list(range(chunks["b"][0], chunks["b"][0] + 4)), log  # whole: no step between
    assert chunks["c"] == list(range(chunks["b"][-1] + 1, chunks["b"][-1] + 5)), log
    for lo, hi in zip(chunks["d"], chunks["d"][1:]):  # then three decode: d goes a chunk per step
        assert any(e[0] == "step" for e in log[lo:hi]), log[lo:hi + 1]


def test_a_caller_that_leaves_mid_prefill_has_its_row_released_once():
    runner = ChunkedRunner(chunks=40, step_s=0.01)
    engine = Engine(runner)
    left = time.monotonic() + 0.15

    def check():
        if time.monotonic() > left:
            raise TimeoutError("deadline")
    try:
        a = _start(engine, "a")
        next(a.tokens(lambda: None))
        with pytest.raises(TimeoutError):
            _start(engine, "b", check=check)
        _wait_for(lambda: "b" in runner.released)
        ran = sum(1 for e in runner.log if e[:2] == ("chunk", "b"))
        time.sleep(0.1)
        assert sum(1 for e in runner.log if e[:2] == ("chunk", "b")) == ran < 40  # its prefill stopped
        a.cancel()
    finally:
        engine.close()
    assert runner.released.count("b") == 1


def test_a_broken_prefill_fails_its_caller_and_the_engine_decodes_on():
    runner = ChunkedRunner(chunks=4, fail={"b"})
    engine = Engine(runner)
    try:
        a, tokens_a = _decoding(engine, "a")
        with pytest.raises(RuntimeError, match="prefill of b broke"):
            _start(engine, "b")
        before = sum(1 for e in runner.log if e[0] == "step")
        next(tokens_a), next(tokens_a)
        _wait_for(lambda: sum(1 for e in runner.log if e[0] == "step") > before)
        a.cancel()
    finally:
        engine.close()
    assert "b" not in runner.released  # the runner forgot the row itself


def test_closing_the_engine_fails_a_waiting_admission_and_releases_its_row():
    runner = ChunkedRunner(chunks=1000, step_s=0.01)
    engine = Engine(runner)
    a = _start(engine, "a")
    next(a.tokens(lambda: None))
    errors: list[BaseException] = []

    def join() -> None:
        try:
            _start(engine, "b")
        except RuntimeError as exc:
            errors.append(exc)
    t = threading.Thread(target=join)
    t.start()
    _wait_for(lambda: any(e[:2] == ("chunk", "b") for e in runner.log))
    engine.close()
    t.join(timeout=5)
    assert not t.is_alive() and len(errors) == 1
    assert runner.released.count("b") == 1


class _Done:
    """A launched step whose tokens are ready when the simulated device has run it."""

    def __init__(self, rows, end):
        self.rows, self.full, self.end = rows, [False] * len(rows), end

    def result(self):
        time.sleep(max(0.0, self.end - time.monotonic()))
        return [1] * len(self.rows)


class QueuedRunner(ChunkedRunner):
    """Overlapped like the GPU runner: launch and a chunk queue work on one simulated device
    (each starts when the work before it ends) and return at once; step_seconds is known."""

    def __init__(self, chunks: int = 1, step_s: float = 0.2) -> None:
        super().__init__(chunks=chunks, step_s=step_s)
        self.device_free = 0.0

    def _queue(self, seconds: float) -> float:
        self.device_free = max(time.monotonic(), self.device_free) + seconds
        return self.device_free

    def begin(self, cid, art, prompt, config, max_new, check):
        def run():
            for i in range(self.chunks):
                with self._lock:
                    self.log.append(("chunk", cid, i, time.monotonic()))
                end = self._queue(self.step_s / 4)
                if i == self.chunks - 1:
                    time.sleep(max(0.0, end - time.monotonic()))  # the caller waits for its logits
                yield LOGITS if i == self.chunks - 1 else None
        return cid, run()

    def launch(self, rows, host_tokens):
        now = time.monotonic()
        with self._lock:
            self.log.append(("launch", tuple(rows), now, now > self.device_free))  # (.., the device idled)
        return _Done(rows, self._queue(self.step_s))

    def step_seconds(self):
        return self.step_s


def test_a_joiner_chunk_goes_ahead_of_the_next_step_and_the_device_never_idles():
    """The next step is launched late in the one in flight, so a prompt arriving early in a
    step has its chunk queued right behind it, not behind one more step; meanwhile every
    launch still comes before the step in flight ends."""
    runner = QueuedRunner(step_s=0.2)
    engine = Engine(runner)
    try:
        a, _ = _decoding(engine, "a", read=2)
        _wait_for(lambda: sum(e[0] == "launch" for e in runner.log) >= 3)
        launches = [e[2] for e in runner.log if e[0] == "launch"]
        joined = time.monotonic()
        assert joined - launches[-1] < 0.1  # early in a step (a launch comes ~3/4 into one)
        _start(engine, "b", max_tokens=1)
        ttft = time.monotonic() - joined
        a.cancel()
    finally:
        engine.close()
    chunk_at = next(e[3] for e in runner.log if e[:2] == ("chunk", "b"))
    assert not [t for t in launches + [e[2] for e in runner.log if e[0] == "launch"] if joined < t < chunk_at]
    assert ttft < 0.2 + 0.05 + 0.1  # the step in flight, the chunk, slack: not one more step
    idled = [e[3] for e in runner.log if e[0] == "launch"]
    assert sum(idled[1:]) <= 1, runner.log  # every launch but the first (and b's end) found work queued


class IdleWorkRunner(ChunkedRunner):
    """Logs idle work; its cache_full (asked after the first token, before the stream joins the
    batch) is slow, which widens the gap in which idle work must not start."""

    def idle_work(self):
        with self._lock:
            self.log.append(("idle",))
        return False

    def cache_full(self, row) -> bool:
        time.sleep(0.05)
        return False


def test_no_idle_work_between_a_prefill_and_its_streams_first_step():
    runner = IdleWorkRunner(chunks=1)
    engine = Engine(runner)
    try:
        a, _ = _decoding(engine, "a", read=2)  # the prefill's token, then the first step's
        a.cancel()
    finally:
        engine.close()
    chunk = runner.log.index(("chunk", "a", 0))
    step = next(i for i, e in enumerate(runner.log) if e[0] == "step")
    assert ("idle",) not in runner.log[chunk:step], runner.log


class HoldingRunner(ChunkedRunner):
    """Holds back every row named in `hold` for the next `times` steps it is offered in."""

    def __init__(self, hold: str, times: int) -> None:
        super().__init__(chunks=1)
        self.hold, self.times = hold, times

    def holds(self, rows):
        held = [r == self.hold and self.times > 0 for r in rows]
        if any(held):
            self.times -= 1
            with self._lock:
                self.log.append(("held", tuple(rows)))
        return held


def test_a_row_the_runner_holds_skips_those_steps_and_then_decodes_on():
    """GpuRunner.holds (reselect's phases): the engine leaves a held row out of the step, keeps
    it live, and steps it afterwards; its tokens are all there."""
    runner = HoldingRunner("b", times=2)
    engine = Engine(runner)
    try:
        a, _ = _decoding(engine, "a")
        b = _start(engine, "b", max_tokens=4)
        assert [t for t, _ in b.tokens(lambda: None)] == [1] * 4
        a.cancel()
    finally:
        engine.close()
    log = runner.log
    held = [i for i, e in enumerate(log) if e[0] == "held"]
    assert len(held) == 2 and all(log[i][1] == ("a", "b") for i in held), log
    for i in held:  # the step offered to both ran without b
        assert next(e for e in log[i:] if e[0] == "step")[1] == ("a",), log
    assert sum("b" in e[1] for e in log if e[0] == "step") == 3  # the prefill gave b's first token
