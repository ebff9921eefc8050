"""The decode engine: one thread steps every live stream together through a model runner.

A stream is admitted in its caller's thread: the runner claims a row and loads its context
there. A runner that shares device buffers between rows (the GPU runner: `begin`) then hands
the question's prefill to the engine thread, which runs it a chunk per decode step, queued
ahead of the next step, so a joining stream never stops the others for its whole prefill; the reference runner, whose rows share nothing, prefills in the caller's thread. The
caller samples the first token, then the stream joins the loop: each step the scheduler picks
the rows, the runner runs the model once over them (weights read once per step, attention per
row), and each row's token goes to its consumer's queue. Streams join and leave between steps.

Model code only: no gRPC here. A consumer reads its tokens with `Sequence.tokens()` and may
cancel at any time; the engine drops a cancelled row before its next step and releases it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ctxcache.artifact import ContextArtifact
from ctxcache.decoder.admission import Admission
from ctxcache.decoder.inflight import LaunchedStep
from ctxcache.decoder.reference_attention import SparseConfig
from ctxcache.decoder.runner import Runner
from ctxcache.decoder.scheduler import Scheduler, StopRule
from ctxcache.generation import SamplingParams, sample

_log = logging.getLogger(__name__)
_END = object()  # queued after a sequence's last token
# an overlapped step is queued this share of a step before its predecessor should end: until
# then an admission's chunk may still go ahead of it (a step queued at once made every joiner
# wait for one more whole step: dense 32K x 7, TTFT p99 75 ms)
LAUNCH_LEAD = 0.25


@dataclass(eq=False)
class Sequence:
    """One stream: its runner row, sampling, stop rule and token queue."""

    row: Any
    path: str  # which runner serves it ("reference", "gpu-sparse", "gpu-dense")
    sampling: SamplingParams
    stop: StopRule
    first_token: int
    first_full: bool
    ended_at_first: bool
    gen: torch.Generator | None = None
    produced: int = 1
    token_on_device: bool = False  # its last token was fed back on the device (an overlapped step)
    out: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    last_token: int = field(init=False)

    def __post_init__(self) -> None:
        self.last_token = self.first_token

    def cancel(self) -> None:
        self.cancelled.set()

    def tokens(self, check: Callable[[], None], poll_s: float = 0.05) -> Iterator[tuple[int, bool]]:
        """Yield (token id, cache full) from the first token on; `check` runs while waiting
        (it raises to stop: deadline, cancellation). Leaving the loop cancels the sequence."""
        try:
            yield self.first_token, self.first_full
            if self.ended_at_first:
                return
            while True:
                try:
                    item = self.out.get(timeout=poll_s)
                except queue.Empty:
                    check()
                    continue
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.cancel()


def _generator(sampling: SamplingParams) -> torch.Generator | None:
    return torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None


class Engine:
    """Continuous batching over one runner, at most `max_batch` rows a step."""

    def __init__(self, runner: Runner, max_batch: int = 32) -> None:
        self.runner = runner
        self.scheduler = Scheduler(max_batch)
        self._wake = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._admissions: list[Admission] = []  # prefills the engine thread runs between steps
        # streams between their call and their first step: no idle work (a graph capture of 80+
        # ms) may start once their prefill is done but before they join the batch
        self._joining = 0
        self.steps = 0  # batched steps run
        self.rows_stepped = 0  # sum of batch sizes (rows_stepped / steps = mean batch)

    def start(self, context_id: str, art: ContextArtifact, prompt: list[int], config: SparseConfig,
              sampling: SamplingParams, check: Callable[[], None] = lambda: None) -> Sequence:
        """Load (and, unless the runner hands it to the engine thread, prefill) in the caller's
        thread, sample the first token, and queue the rest for batching."""
        if self._closed:
            raise RuntimeError("the decode engine is closed")
        with self._wake:
            self._joining += 1
        try:
            return self._join(context_id, art, prompt, config, sampling, check)
        finally:
            with self._wake:
                self._joining -= 1

    def _join(self, context_id: str, art: ContextArtifact, prompt: list[int], config: SparseConfig,
              sampling: SamplingParams, check: Callable[[], None]) -> Sequence:
        if hasattr(self.runner, "begin"):
            row, first_logits = self._admit_in_loop(context_id, art, prompt, config, sampling.max_tokens, check)
        else:
            row, first_logits = self.runner.admit(context_id, art, prompt, config, sampling.max_tokens, check)
        gen = _generator(sampling)
        tok = int(sample(first_logits[None], sampling, gen)[0])
        stop = StopRule(sampling.max_tokens, frozenset(sampling.stop_token_ids))
        full = self.runner.cache_full(row)
        ends = stop.done(tok, 1, full)
        seq = Sequence(row, self.runner.name, sampling, stop, tok, full, ends, gen=gen)
        if ends:
            self.runner.release(row)
            return seq
        with self._wake:
            if self._closed:
                self.runner.release(row)
                raise RuntimeError("the decode engine is closed")
            self.scheduler.admit(seq)
            self._ensure_thread()
            self._wake.notify()
        return seq

    def _admit_in_loop(self, context_id: str, art: ContextArtifact, prompt: list[int], config: SparseConfig,
                       max_new: int, check: Callable[[], None]) -> tuple[Any, torch.Tensor]:
        """Claim and load here; the engine thread runs the prompt's prefill a chunk per step."""
        row, chunks = self.runner.begin(context_id, art, prompt, config, max_new, check)
        admission = Admission(row, chunks, self.runner.release)
        with self._wake:
            if self._closed:
                admission.fail(RuntimeError("the decode engine is closed"))
            else:
                self._admissions.append(admission)
                self._ensure_thread()
                self._wake.notify()
        return row, admission.wait(check)

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=f"ctxcache-engine-{self.runner.name}",
                                            daemon=True)
            self._thread.start()

    def _next_batch(self, wait: bool = True) -> list[Sequence] | None:
        """The next step's rows; [] when none is live and `wait` is off or an admission waits;
        None once closed."""
        with self._wake:
            while not self._closed:
                gone = [s for s in self.scheduler.live() if s.cancelled.is_set()]
                self._retire(gone)
                batch = self.scheduler.next_batch()
                if batch or not wait or self._admissions:
                    break
                self._wake.wait()
            else:
                return None
        return self._unheld(batch)  # outside the engine's lock: holds takes the runner's

    def _unheld(self, batch: list[Sequence]) -> list[Sequence]:
        """The batch less the rows the runner holds back a step (GpuRunner.holds: a row due to
        select while the others carry their selection); they stay live and step later."""
        holds = getattr(self.runner, "holds", None)
        if holds is None or not batch:
            return batch
        return [s for s, held in zip(batch, holds([s.row for s in batch])) if not held]

    def _idle_work(self) -> bool:
        """With no stream and no admission, one piece of the runner's idle work (a prefill
        graph capture); -> whether it did one (the loop then looks for work before the next)."""
        with self._wake:
            if self.scheduler.live() or self._admissions or self._joining or self._closed:
                return False
        return hasattr(self.runner, "idle_work") and self.runner.idle_work()

    def _admit_some(self, decoding: int) -> None:
        """Beside a step of `decoding` rows: the oldest admissions to their end while more wait
        than decode, then one prefill chunk of the next (the step's token budget); with nothing
        decoding, every waiting admission to its end.

        Why the burst rule: a chunk per step protects the decoding streams' inter-token gaps from
        a joiner's prefill, but when a burst arrives the first stream starts decoding alone and
        every other waited a step per chunk of each one ahead of it; the few decoding streams now
        wait for the whole burst instead (H200, 32K, eight streams at once: slowest TTFT 0.215 ->
        0.127 s, 707 -> 820 tok/s, serve_reselect2_h200)."""
        with self._wake:
            waiting = list(self._admissions)
        whole = max(0, len(waiting) - decoding) if decoding else len(waiting)
        for i, admission in enumerate(waiting[:whole + 1]):
            while not admission.advance():
                if i == whole or self._closed:  # close() fails what is still waiting
                    return
            with self._wake:
                if admission in self._admissions:
                    self._admissions.remove(admission)

    def _retire(self, seqs: list[Sequence]) -> None:
        if seqs:
            self.scheduler.retire(seqs)
            for s in seqs:
                self.runner.release(s.row)

    def _loop(self) -> None:
        """Overlapped where the runner can launch a step without waiting (all rows greedy): step
        N+1 is queued late in step N (LAUNCH_LEAD), before N's tokens are handed out, so the
        device never waits for this thread and a joiner's chunk may still go first; otherwise
        each step ends in a device sync, as a sampled row needs its logits."""
        in_flight: tuple[list[Sequence], LaunchedStep] | None = None
        running_since = 0.0  # when the step in flight started on the device (as seen here)
        try:
            while (batch := self._next_batch(wait=in_flight is None and not self._idle_work())) is not None:
                launched = None
                if in_flight is not None and batch and self._overlaps(batch):
                    self._await_launch_point(running_since)
                # an admission's chunk is queued ahead of the step: its stream's first token is
                # ready a step sooner, and the streams decoding wait the same
                self._admit_some(decoding=len(batch))
                if batch and self._overlaps(batch):
                    launched = self._guarded(batch, self._launch)
                if in_flight is not None:
                    self._guarded(in_flight[0], lambda b: self._hand_out(b, in_flight[1]))
                    running_since = time.perf_counter()  # the step just launched runs from here
                in_flight = (batch, launched) if launched is not None else None
                if batch and launched is None and not self._overlaps(batch):
                    self._guarded(batch, self._step)
            if in_flight is not None:
                self._guarded(in_flight[0], lambda b: self._hand_out(b, in_flight[1]))
        except BaseException as exc:  # noqa: BLE001 - the loop itself broke (a row's release failed)
            _log.exception("the decode engine's loop stopped")
            self._fail_all(exc)

    def _await_launch_point(self, running_since: float) -> None:
        """Hold the next launch until an admission waits or the step in flight is due to end
        within LAUNCH_LEAD of a step (the runner's measured step time; no wait without one)."""
        step_s = self.runner.step_seconds() if hasattr(self.runner, "step_seconds") else None
        if step_s is None:
            return
        launch_at = running_since + (1.0 - LAUNCH_LEAD) * step_s
        with self._wake:
            while not self._admissions and not self._closed and (left := launch_at - time.perf_counter()) > 0:
                self._wake.wait(left)

    @staticmethod
    def _guarded(batch: list[Sequence], run: Callable[[list[Sequence]], Any]) -> Any:
        try:
            return run(batch)
        except Exception as exc:  # noqa: BLE001 - handed to each consumer, the engine lives on
            for s in batch:
                s.cancel()
                s.out.put(exc)
            return None

    def _overlaps(self, batch: list[Sequence]) -> bool:
        return hasattr(self.runner, "launch") and all(s.sampling.temperature == 0.0 for s in batch)

    @torch.inference_mode()
    def _launch(self, batch: list[Sequence]) -> LaunchedStep:
        host = [None if s.token_on_device else s.last_token for s in batch]
        launched = self.runner.launch([s.row for s in batch], host)
        for s in batch:
            s.token_on_device = True
        self.steps += 1
        self.rows_stepped += len(batch)
        return launched

    def _hand_out(self, batch: list[Sequence], launched: LaunchedStep) -> None:
        """Step N's tokens to their streams (rows that ended meanwhile get nothing more)."""
        for s, tok, full in zip(batch, launched.result(), launched.full):
            if not s.cancelled.is_set():
                self._emit(s, tok, full)

    def _emit(self, s: Sequence, tok: int, full: bool) -> None:
        s.last_token, s.produced = tok, s.produced + 1
        s.out.put((tok, full))
        if s.stop.done(tok, s.produced, full):
            s.cancel()  # retired (and its row released) before the next step
            s.out.put(_END)

    def _fail_all(self, exc: BaseException) -> None:
        """Close the engine and hand `exc` to every live consumer: none waits on a dead thread."""
        with self._wake:
            self._closed = True
            live = self.scheduler.live()
            self.scheduler.retire(live)
            waiting, self._admissions = self._admissions, []
        for s in live:
            s.cancel()
            s.out.put(RuntimeError(f"the decode engine stopped: {exc!r}"))
        for admission in waiting:
            admission.fail(RuntimeError(f"the decode engine stopped: {exc!r}"))

    @torch.inference_mode()
    def _step(self, batch: list[Sequence]) -> None:
        logits = self.runner.step([s.row for s in batch], [s.last_token for s in batch])
        self.steps += 1
        self.rows_stepped += len(batch)
        greedy = logits.argmax(-1).tolist()  # one device sync per step, for every greedy row
        for b, s in enumerate(batch):
            tok = greedy[b] if s.sampling.temperature == 0.0 else int(sample(logits[b:b + 1], s.sampling, s.gen)[0])
            s.token_on_device = False
            self._emit(s, tok, self.runner.cache_full(s.row))

    def close(self) -> None:
        """Stop the thread; live sequences end (their consumers see the end of tokens)."""
        with self._wake:
            self._closed = True
            live = self.scheduler.live()
            self.scheduler.retire(live)
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._wake:
            waiting, self._admissions = self._admissions, []
        for admission in waiting:
            admission.fail(RuntimeError("the decode engine is closed"))
        for s in live:
            s.cancel()
            s.out.put(_END)
            self.runner.release(s.row)
