"""Decoder worker: Generate streams over cached artifacts (bounded, cancellable, timed).

A stream acquires its artifact from the DRAM cache before decoding anything, so it either
holds a complete artifact for its whole life or fails (NOT_FOUND / DATA_LOSS) before its
first token. Each stream prefills its question in its gRPC handler thread (the core's
`start_batch`), samples its first token there, then joins the shared `DecodeBatcher`, which
steps all live streams as one batch; the handler thread streams its tokens out and checks
cancellation and its deadline while it waits.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from ctxcache.artifact import ContextArtifact
from ctxcache.decoder import SparseConfig, start_batch
from ctxcache.decoder.batching import DecodeBatcher
from ctxcache.generation import SamplingParams
from ctxcache.models.loader import LoadedModel
from ctxcache.service.artifact_cache import ArtifactCache
from ctxcache.service.errors import Cancelled, DeadlineExceeded, InvalidArgument, ResourceExhausted
from ctxcache.service.metrics import Metrics
from ctxcache.service.prompting import Messages, Prompter
from ctxcache.service.textstream import TextStream


@dataclass(frozen=True)
class CachedContext:
    """What the DRAM cache holds: the artifact and the roles its context was rendered with."""

    artifact: ContextArtifact
    roles: tuple[str, ...]
    stored_bytes: int

    def nbytes(self) -> int:
        a = self.artifact
        return a.kv_bytes() + a.table_bytes() + a.tokens.numel() * 8 + a.last_logits.numel() * 4


@dataclass(frozen=True)
class GenerateSpec:
    context_id: str
    turn: Messages
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    schedule: str = ""


@dataclass(frozen=True)
class Chunk:
    text: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class Final:
    text: str
    finish_reason: str  # stop | stop_sequence | length | context_limit
    cached_tokens: int
    new_prompt_tokens: int
    generated_tokens: int
    ttft_seconds: float
    tokens_per_second: float
    load_seconds: float
    total_seconds: float
    cache_hit: bool


class Decoder:
    def __init__(self, lm: LoadedModel, prompter: Prompter, cache: ArtifactCache[CachedContext],
                 max_streams: int, default_schedule: str, metrics: Metrics, max_batch: int = 32) -> None:
        self.lm, self.prompter, self.cache, self.metrics = lm, prompter, cache, metrics
        self.batcher = DecodeBatcher(lm.model, max_batch)
        self.default_schedule = default_schedule
        self._slots = threading.BoundedSemaphore(max_streams)
        self.active = 0
        self._lock = threading.Lock()

    def stream(self, spec: GenerateSpec, alive: Callable[[], bool], deadline: float | None,
               t_request: float) -> Iterator[Chunk | Final]:
        """deadline: time.monotonic() value or None. Raises ResourceExhausted when full."""
        if not self._slots.acquire(blocking=False):
            self.metrics.rejected.labels("Generate").inc()
            raise ResourceExhausted("too many concurrent Generate streams; retry later")
        with self._lock:
            self.active += 1
        self.metrics.streams.inc()
        try:
            yield from self._run(spec, alive, deadline, t_request)
        finally:
            self.metrics.streams.dec()
            with self._lock:
                self.active -= 1
            self._slots.release()

    def close(self) -> None:
        self.batcher.close()

    def _config(self, schedule: str) -> SparseConfig:
        try:
            return SparseConfig.from_schedule(schedule or self.default_schedule)
        except ValueError as exc:
            raise InvalidArgument("schedule", str(exc)) from exc

    def _run(self, spec: GenerateSpec, alive: Callable[[], bool], deadline: float | None,
             t0: float) -> Iterator[Chunk | Final]:
        config = self._config(spec.schedule)
        loaded = self.cache.acquire(spec.context_id)  # NOT_FOUND / DATA_LOSS before any token
        self.metrics.cache_lookups.labels("hit" if loaded.hit else "miss").inc()
        if not loaded.hit:
            self.metrics.bytes_loaded.inc(loaded.value.stored_bytes)
            self.metrics.load_seconds.observe(loaded.load_seconds)
        ctx, art = loaded.value, loaded.value.artifact
        placeholder = [{"role": r, "content": "x"} for r in ctx.roles]
        prompt = self.prompter.turn_tokens(placeholder, spec.turn)
        room = self.lm.args.max_seq_len - art.n_tokens - len(prompt)
        if room < 1:
            raise InvalidArgument("question", f"{len(prompt)} new tokens after {art.n_tokens} cached "
                                  f"exceed the model's maximum length {self.lm.args.max_seq_len}")
        sampling = replace(spec.sampling, max_tokens=min(spec.sampling.max_tokens, room),
                           stop_token_ids=self.prompter.stop_token_ids)
        _check(alive, deadline)
        first, attn, cache = start_batch(self.lm, [art], [prompt], config, sampling.max_tokens)
        seq = self.batcher.start(first[0], cache, attn, sampling)
        text, n, reason, t_first = TextStream(self.prompter.tokenizer, spec.stop), 0, "length", 0.0
        for tid, cache_full in seq.tokens(lambda: _check(alive, deadline)):
            n += 1
            if n == 1:
                t_first = time.perf_counter()
            if tid in sampling.stop_token_ids:
                reason = "stop"
                break
            piece = text.push(tid)
            yield Chunk(piece, (tid,))
            if text.stopped:
                reason = "stop_sequence"
                break
            if cache_full:
                reason = "context_limit"
                break
            _check(alive, deadline)
        else:
            if sampling.max_tokens < spec.sampling.max_tokens:
                reason = "context_limit"
        tail = text.flush()
        if tail:
            yield Chunk(tail, ())
        yield self._final(text, reason, art, prompt, n, t0, t_first, loaded)

    def _final(self, text: TextStream, reason: str, art: ContextArtifact, prompt: list[int], n: int,
               t0: float, t_first: float, loaded) -> Final:
        now = time.perf_counter()
        ttft = (t_first or now) - t0
        tps = (n - 1) / (now - t_first) if n > 1 and now > t_first else 0.0
        self.metrics.ttft.observe(ttft)
        self.metrics.generated_tokens.inc(n)
        if tps:
            self.metrics.tokens_per_second.observe(tps)
        full = text.tokenizer.decode(text.ids, skip_special_tokens=True)
        return Final(full[:text.emitted] if text.stopped else full, reason, art.n_tokens, len(prompt), n,
                     ttft, tps, loaded.load_seconds, now - t0, loaded.hit)


def _check(alive: Callable[[], bool], deadline: float | None) -> None:
    if deadline is not None and time.monotonic() >= deadline:
        raise DeadlineExceeded("deadline exceeded while decoding")
    if not alive():
        raise Cancelled("the client cancelled the stream")
