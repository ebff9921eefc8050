"""Continuous batching of decode steps across independent streams.

Each stream prefills its own question into its own one-row cache (`start_batch`), then hands
the decoding to one `DecodeBatcher` thread. Every step the batcher runs the model once over
all live streams: the weight-bound parts (projections, MLP, LM head) see a batch of B rows,
so the weights are read once per step instead of once per stream, while attention and the
sparse index stay per row (each row has its own cache, artifact and sparse state). Streams
join and leave between steps. On a 2-core CPU, 16 batch-1 threads share the weight reads
badly (about 7 tokens/s in total); one batched step serves all of them.

Model code only: no gRPC here. A consumer reads its tokens with `Sequence.tokens()` and may
cancel at any time; the batcher drops a cancelled row before its next step.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from ctxcache.generation import SamplingParams, sample
from ctxcache.models.kv_cache import KVCache
from ctxcache.models.llama import AttentionFn, Transformer

_END = object()  # queued after a sequence's last token


@dataclass(eq=False)
class Sequence:
    """One stream's decoding state: its cache row, attention, sampling and token queue."""

    cache: KVCache
    attn: AttentionFn
    sampling: SamplingParams
    first_token: int  # sampled from the prefill logits
    first_full: bool  # the cache was already full after the prefill
    ended_at_first: bool  # decoding ends with the first token (stop token, max_tokens, full)
    gen: torch.Generator | None = None
    produced: int = 1
    out: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    last_token: int = field(init=False)

    def __post_init__(self) -> None:
        self.last_token = self.first_token

    def cancel(self) -> None:
        self.cancelled.set()

    def cache_full(self) -> bool:
        return int(self.cache.lengths[0]) >= self.cache.max_len

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


class _RowCaches:
    """Looks like one KVCache to `Transformer.forward` but writes each row to its own cache."""

    def __init__(self, caches: list[KVCache]) -> None:
        self.caches = caches

    @property
    def max_len(self) -> int:
        return max(c.max_len for c in self.caches)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        for b, c in enumerate(self.caches):
            c.write(layer, k[b:b + 1], v[b:b + 1], pos[b:b + 1])


class _RowAttention:
    """Runs each row's own attention callable against its own cache."""

    def __init__(self, seqs: list[Sequence]) -> None:
        self.seqs = seqs

    def __call__(self, layer: int, q: torch.Tensor, cache: _RowCaches, pos: torch.Tensor) -> torch.Tensor:
        return torch.cat([s.attn(layer, q[b:b + 1], s.cache, pos[b:b + 1]) for b, s in enumerate(self.seqs)])


class DecodeBatcher:
    """One thread that steps every live sequence together, at most `max_batch` rows a step
    (the rest wait their turn, oldest first)."""

    def __init__(self, model: Transformer, max_batch: int = 32) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch} must be >= 1")
        self.model, self.max_batch = model, max_batch
        self._live: list[Sequence] = []
        self._wake = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.steps = 0  # batched steps run
        self.rows_stepped = 0  # sum of batch sizes (rows_stepped / steps = mean batch)

    def start(self, first_logits: torch.Tensor, cache: KVCache, attn: AttentionFn,
              sampling: SamplingParams) -> Sequence:
        """Sample the first token from the prefill logits [V] (in the caller's thread, so the
        time to first token does not wait for a batch step) and queue the rest for batching."""
        gen = torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None
        tok = int(sample(first_logits[None], sampling, gen)[0])
        full = int(cache.lengths[0]) >= cache.max_len
        ends = tok in sampling.stop_token_ids or sampling.max_tokens <= 1 or full
        seq = Sequence(cache, attn, sampling, tok, full, ends, gen=gen)
        if not ends:
            with self._wake:
                if self._closed:
                    raise RuntimeError("the decode batcher is closed")
                self._live.append(seq)
                self._ensure_thread()
                self._wake.notify()
        return seq

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="ctxcache-decode-batcher", daemon=True)
            self._thread.start()

    @staticmethod
    def _done(seq: Sequence, tok: int) -> bool:
        return (tok in seq.sampling.stop_token_ids or seq.produced >= seq.sampling.max_tokens
                or seq.cache_full())

    def _next_batch(self) -> list[Sequence] | None:
        with self._wake:
            while not self._closed:
                self._live = [s for s in self._live if not s.cancelled.is_set()]
                if self._live:
                    batch = self._live[:self.max_batch]
                    # rotate so rows beyond max_batch get the next step
                    self._live = self._live[self.max_batch:] + batch
                    return batch
                self._wake.wait()
            return None

    def _loop(self) -> None:
        while (batch := self._next_batch()) is not None:
            try:
                self._step(batch)
            except BaseException as exc:  # noqa: BLE001 - handed to each consumer, batcher lives on
                for s in batch:
                    s.cancel()
                    s.out.put(exc)

    @torch.inference_mode()
    def _step(self, batch: list[Sequence]) -> None:
        device = batch[0].cache.lengths.device
        tokens = torch.tensor([[s.last_token] for s in batch], device=device)
        pos = torch.cat([s.cache.lengths[:, None] for s in batch])
        logits = self.model(tokens, pos, _RowCaches([s.cache for s in batch]), _RowAttention(batch))[:, -1]
        self.steps += 1
        self.rows_stepped += len(batch)
        for b, s in enumerate(batch):
            s.cache.lengths += 1
            tok = int(sample(logits[b:b + 1], s.sampling, s.gen)[0])
            s.last_token, s.produced = tok, s.produced + 1
            s.out.put((tok, s.cache_full()))
            if self._done(s, tok):
                s.cancel()  # leaves the live list at the next step
                s.out.put(_END)

    def close(self) -> None:
        """Stop the thread; live sequences end (their consumers see the end of tokens)."""
        with self._wake:
            self._closed = True
            live, self._live = self._live, []
            self._wake.notify_all()
        for s in live:
            s.cancel()
            s.out.put(_END)
        if self._thread is not None:
            self._thread.join(timeout=5)
