"""What the fast runner and the offload runner share about their slots: claiming one for a
context, forgetting one, evicting a context, and one bucketed step of graph replays over the
given rows. A runner brings `slots` (each with index, context_id, busy, last_used, length), a
`lock` (threading.Condition), `buckets`, `device`, `_decoder(bucket)`, `io` (inflight.StepIO), `times`
(device_times.DeviceTimes), `cache_full(row)`, and may override
`_settle(rows)`, which runs before a step touches the rows (the offload runner puts a joined
row's state back there), and `_step_decoder(bucket, rows)`, the graph a step of these rows
replays (the fast runner's lean step where every row carries its selection), and sets
`carried_rows` (table_stacks.carried_views) when it allocates its tables."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from ctxcache.decoder.gpu.slot_prefill import ResidentHead
from ctxcache.decoder.inflight import LaunchedStep
from ctxcache.decoder.runner import ContextNotResident


class SlotRows:
    slots: list[Any]
    lock: Any
    buckets: list[int]
    device: torch.device

    io: Any
    times: Any
    _last_step: str  # the device-time kind of the last launched step ("step 8", "step 8 lean")
    _decoder: Callable[[int], Any]  # the bucket's GraphDecoder (each runner's own)
    cache_full: Callable[[Any], bool]
    carried_rows: tuple[torch.Tensor, ...] = ()  # [layers, slots, ...]: table_stacks.carried_views

    def _settle(self, rows: list[Any]) -> None:
        """Before a step reads the rows (nothing by default)."""

    def _step_decoder(self, bucket: int, rows: list[Any]) -> Any:
        """The GraphDecoder a step of these rows replays (the bucket's, by default)."""
        return self._decoder(bucket)

    def _unstepped(self, rows: list[Any], bucket: int) -> Callable[[], None]:
        """A step computes a throw-away token for the rows of its bucket it does not step, and
        its re-rank rewrites their follow state: the state of a stream holding such a row (one
        decoding while another's one-token question is admitted by a step, or one whose
        question's prefill runs a chunk of layers between steps) is copied first; -> what puts
        it back after the step (stream order: before any later step reads it)."""
        stepped = {s.index for s in rows}
        held = [s.index for s in self.slots if s.busy and s.index < bucket and s.index not in stepped]
        if not self.carried_rows or not held:
            return lambda: None
        kept = [(state[:, i], state[:, i].clone()) for state in self.carried_rows for i in held]

        def put_back() -> None:
            for state, before in kept:
                state.copy_(before)
        return put_back

    def _without_prefill(self, slot: Any, prompt: list[int], art: Any) -> Iterator[torch.Tensor]:
        """A prompt of one token is a decode step of the slot (as on the reference path); no
        prompt: the context's own last logits."""
        if prompt:
            return iter([self._step_rows([slot], prompt)[0]])
        return iter([art.last_logits.to(self.device).float()])

    def _forget(self, slot: Any) -> None:
        """A row whose load or prefill failed holds no context (call under the lock)."""
        slot.context_id, slot.busy = None, False
        self.lock.notify_all()

    def _claim(self, context_id: str, check: Callable[[], None], art: Any = None) -> Any:
        """A slot for the context: its idle resident slot, else an empty one, else the least
        recently used idle one; waits (running `check`) while every slot is busy. ContextNotResident
        where `art` is a head (ResidentHead) and no slot holds the context any more (nothing to load)."""
        while True:
            idle = [s for s in self.slots if not s.busy]
            pick = (next((s for s in idle if s.context_id == context_id), None)
                    or next((s for s in idle if s.context_id is None), None)
                    or min(idle, key=lambda s: s.last_used, default=None))
            if pick is not None and pick.context_id != context_id and isinstance(art, ResidentHead):
                raise ContextNotResident(context_id)  # untouched: whatever it holds stays
            if pick is not None:
                pick.busy = True
                return pick
            check()
            self.lock.wait(timeout=0.05)

    def resident_head(self, context_id: str) -> Any:
        """The head (slot_prefill.ResidentHead) of the context if a slot holds it: a stream may
        start from it, skipping the DRAM tier and the store behind it."""
        with self.lock:
            return next((s.head for s in self.slots if s.context_id == context_id), None)

    def evict(self, context_id: str) -> bool:
        """Forget the context's idle slots (a busy one keeps serving its stream and is reloaded
        for the next); -> whether any slot held it."""
        with self.lock:
            held = [s for s in self.slots if s.context_id == context_id]
            for s in held:  # a busy one's id is never matched again: the next stream reloads
                s.context_id = None if not s.busy else f"evicted:{context_id}"
            return bool(held)

    def _bucket(self, rows: list[Any]) -> int:
        return next(b for b in self.buckets if b > max(s.index for s in rows))

    @torch.inference_mode()
    def step(self, rows: list[Any], tokens: list[int]) -> torch.Tensor:
        """One batched step of the given rows: -> logits [len(rows), V]."""
        with self.lock:
            return self._step_rows(rows, tokens)

    @torch.inference_mode()
    def launch(self, rows: list[Any], host_tokens: list[int | None]) -> LaunchedStep:
        """Queue one greedy step without waiting for the device: a row's input is its token of
        the previous launched step (on the device) or host_tokens' entry where not None."""
        with self.lock:
            self._settle(rows)
            bucket = self._bucket(rows)
            index = [s.index for s in rows]
            tokens, advance = self.io.stage(bucket, index, host_tokens)
            dec = self._step_decoder(bucket, rows)
            logits = self._run_timed(dec, bucket, rows, tokens)
            dec.cache.lengths += advance
            for s in rows:
                s.length += 1
            return self.io.finish(logits, advance, index, [self.cache_full(s) for s in rows])

    def _run_timed(self, dec: Any, bucket: int, rows: list[Any], tokens: torch.Tensor) -> torch.Tensor:
        """Run the bucket's step on the staged tokens, its device time measured (step_seconds)."""
        # replays only: a bucket's first run captures its graph (seconds in the warm-up), and
        # an estimate holding that held the engine's next launches back for a whole run
        started = self.times.start() if dec.graph is not None else None
        put_back = self._unstepped(rows, bucket)
        logits = dec.run(tokens)
        put_back()
        self._last_step = f"step {bucket}{dec.label}"
        self.times.stop(self._last_step, started)
        return logits

    def _step_rows(self, rows: list[Any], tokens: list[int]) -> torch.Tensor:
        self._settle(rows)
        bucket = self._bucket(rows)
        tok, advance = [0] * bucket, [0] * bucket
        for s, t in zip(rows, tokens):
            tok[s.index], advance[s.index] = t, 1
        dec = self._step_decoder(bucket, rows)
        logits = self._run_timed(dec, bucket, rows, torch.tensor(tok, device=self.device))
        dec.cache.lengths += torch.tensor(advance, device=self.device)
        for s in rows:
            s.length += 1
        return logits[[s.index for s in rows]]  # a copy: the graph's buffer is reused
