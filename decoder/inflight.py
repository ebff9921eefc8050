"""Host <-> device traffic of overlapped decode steps: no step waits for the host.

A launched step reads its input tokens on the device (each row's greedy token of its previous
step, fed back there) except where the host hands one in (a stream's first step after its
prompt, or after a step sampled on the host); its greedy tokens go back through a pinned buffer
by a non-blocking copy whose event the engine waits on one step later, while the next step
already runs (mini-sglang's overlap loop, SGLang's FutureMap). Two buffers of each kind
alternate; a buffer is rewritten only after the step that last used it is done, so a caller
that never waits cannot overwrite a copy in flight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(eq=False)
class LaunchedStep:
    """A decode step in flight: rows (slot indices, in the caller's order) and each row's
    cache_full after the step; result() waits for its tokens."""

    rows: list[int]
    full: list[bool]
    tokens: torch.Tensor  # [slots] host buffer the step's greedy tokens land in
    done: torch.cuda.Event | None

    def result(self) -> list[int]:
        """The stepped rows' greedy tokens (waits only for this step's copy)."""
        if self.done is not None:
            self.done.synchronize()
        host = self.tokens.tolist()
        return [host[i] for i in self.rows]


@dataclass(eq=False)
class HostLogits:
    """A prompt's last logits on their way to pinned host memory: the stream's caller waits for
    this copy alone, not for the decode step the engine queues behind the prompt's last chunk
    (a device read such as .item() would wait for that step too: one more step of TTFT)."""

    host: torch.Tensor
    done: torch.cuda.Event | None

    @classmethod
    def start(cls, logits: torch.Tensor) -> "HostLogits":
        if logits.device.type != "cuda":
            return cls(logits, None)
        host = torch.empty(logits.shape, dtype=logits.dtype, pin_memory=True)
        host.copy_(logits, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return cls(host, done)

    def result(self) -> torch.Tensor:
        if self.done is not None:
            self.done.synchronize()
        return self.host


class StepIO:
    """Staging for `slots` rows: per step [advance, from_host, host_token] in, greedy tokens out."""

    def __init__(self, slots: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.device = device
        self.next_tokens = torch.zeros(slots, dtype=torch.long, device=device)  # each row's next input
        # [row, (advance, from_host, host_token)]: a bucket's rows are one contiguous block, so
        # its copy is a true async copy from pinned memory (a strided slice went through a
        # pageable temporary, whose copy waits for the stream: the launch then held the runner's
        # lock for a whole step and admissions starved, H100 32K x 8: 190 tok/s for 540)
        self._staged = [torch.zeros(slots, 3, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self._inputs = [torch.zeros(slots, 3, dtype=torch.long, device=device) for _ in range(2)]
        self._out = [torch.zeros(slots, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self._done: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    def stage(self, bucket: int, rows: list[int], host_tokens: list[int | None]) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (input tokens [bucket], advance [bucket]) on the device, for the rows stepped."""
        turn = self._turn
        if self._done[turn] is not None:
            self._done[turn].synchronize()  # the step that last read these buffers is done
        staged = self._staged[turn][:bucket]
        staged.zero_()
        for row, tok in zip(rows, host_tokens):
            staged[row, 0] = 1
            if tok is not None:
                staged[row, 1], staged[row, 2] = 1, tok
        inputs = self._inputs[turn][:bucket]
        inputs.copy_(staged, non_blocking=True)
        advance, from_host, host_tok = inputs.unbind(1)
        return torch.where(from_host.bool(), host_tok, self.next_tokens[:bucket]), advance

    def finish(self, logits: torch.Tensor, advance: torch.Tensor, rows: list[int], full: list[bool]) -> LaunchedStep:
        """Feed the stepped rows' greedy tokens back on the device and start their copy home."""
        turn = self._turn
        bucket = logits.shape[0]
        greedy = logits.argmax(-1)
        self.next_tokens[:bucket] = torch.where(advance.bool(), greedy, self.next_tokens[:bucket])
        out = self._out[turn]
        out[:bucket].copy_(greedy, non_blocking=True)
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        self._done[turn] = done
        self._turn ^= 1
        return LaunchedStep(rows, full, out, done)
