"""CSAttention reselect's countdowns mirrored on the host, so the fast runner can skip the
selector on a step where every row carries its last selection. No torch.

With reselect = r > 1 a row's step selects afresh when its countdown is 0 (then sets it to
r - 1) and otherwise carries: it re-ranks its last selection, its best keys' successors and the
new key, and counts down (GpuDenseTables.reselect_left on the device, moved by the step itself).
The mirror moves the same way for the rows a step steps, so the runner knows before a launch:

- whether every stepped row carries: that step replays a lean graph without the selector's
  launches (route, scores, promote, radix Top-K);
- which rows to hold: a row due to select while others of its step carry waits for the step where
  they select too, so streams that joined at different steps fall into phase and later steps stay
  lean. A row is held at most r - 1 steps in a row, so none waits longer.

A held row's tokens are those it would have had: its countdown only moves when it steps."""

from __future__ import annotations


class ReselectPhase:
    """Per-row countdowns of a runner's slots (reselect <= 1: nothing carries, nothing is held)."""

    def __init__(self, reselect: int, rows: int) -> None:
        if reselect < 1 or rows < 1:
            raise ValueError(f"reselect={reselect} and rows={rows} must be >= 1")
        self.reselect = reselect
        self.left = [0] * rows  # steps until the row selects again (0: its next step selects)
        self.held = [0] * rows  # steps the row has been held in a row

    def reset(self, row: int) -> None:
        """A new stream in the row: its first step selects (GpuDenseTables.reset_stream)."""
        self.left[row] = self.held[row] = 0

    def holds(self, rows: list[int]) -> list[bool]:
        """Which of a step's rows wait: those due to select while another carries, unless held
        r - 1 steps already (then the step mixes both, as without the mirror)."""
        if self.reselect == 1 or all(self.left[r] == 0 for r in rows):
            return [False] * len(rows)
        held = [self.left[r] == 0 and self.held[r] < self.reselect - 1 for r in rows]
        for r, h in zip(rows, held):
            self.held[r] += h
        return held

    def stepped(self, rows: list[int]) -> bool:
        """The rows are stepped (as the device moves their countdowns); -> whether all carried."""
        lean = self.reselect > 1 and all(self.left[r] > 0 for r in rows)
        for r in rows:
            self.left[r] = self.left[r] - 1 if self.left[r] > 0 else self.reselect - 1
            self.held[r] = 0
        return lean
