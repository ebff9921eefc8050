"""Which decode mode `auto` (the default) picks, per device and context length.

The table holds, per torch device type, the context length from which sparse decoding is
faster than dense; the benchmarks' results behind each entry are named beside it and
tests/core/test_decode_mode_table.py checks the entries against those result files. `sparse` and
`dense` stay explicit modes: `resolve` returns them unchanged.

- CPU (the reference runner, one stream): dense at every context length measured. At 4K on
  SmolLM2 (fp32) the sparse step scores every key on its routed rows, derived per step from the
  fp64 subspace keys (as many bytes as the fp32 K and V that dense attention reads), then
  re-ranks 4x the kept keys exactly: more work than dense attention's two matmuls at any length
  (bench/results/decode_modes_cpu.json).
- GPU (the fast runner, chosen once per server: its slots are sized for one mode): sparse. In
  `bench serve` (Llama-3.1-8B shapes) sparse decodes faster at 32K x 8 streams (H100 1.39x,
  H200 1.13x) and at 124K x 1 (1.18x, 1.04x); dense only at 32K x 1 (H100 1.10x, H200 1.17x),
  a single stream a served runner rarely holds for long (bench/results/serve_h100.json,
  serve_h200.json).
"""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("auto", "sparse", "dense")


@dataclass(frozen=True)
class Crossover:
    """sparse_from: context tokens from which sparse decodes faster (None: dense at every length
    measured); measured: the result files the entry comes from."""

    sparse_from: int | None
    measured: tuple[str, ...]

    def __post_init__(self) -> None:
        if self.sparse_from is not None and self.sparse_from < 0:
            raise ValueError(f"sparse_from={self.sparse_from} must be >= 0 or None")


CROSSOVERS: dict[str, Crossover] = {
    "cpu": Crossover(None, ("bench/results/decode_modes_cpu.json",)),
    "cuda": Crossover(0, ("bench/results/serve_h100.json", "bench/results/serve_h200.json")),
}


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"decode mode {mode!r} must be one of {MODES}")
    return mode


def resolve(mode: str, device_type: str, context_tokens: int) -> str:
    """'sparse' or 'dense': the explicit mode, or auto's pick for this device and context
    (a device with no entry decodes sparse, the mode every method serves)."""
    if check_mode(mode) != "auto":
        return mode
    entry = CROSSOVERS.get(device_type)
    if entry is None:
        return "sparse"
    return "sparse" if entry.sparse_from is not None and context_tokens >= entry.sparse_from else "dense"


def describe(mode: str, device_type: str) -> str:
    """The mode as `admin stats` reports it: an explicit one as is, auto with its pick here."""
    if check_mode(mode) != "auto":
        return mode
    entry = CROSSOVERS.get(device_type)
    if entry is None or entry.sparse_from == 0:
        return f"auto: sparse at every context length ({device_type})"
    if entry.sparse_from is None:
        return f"auto: dense at every context length ({device_type})"
    return f"auto: dense below {entry.sparse_from} context tokens, sparse from there ({device_type})"


def decode_path(runner: str, dense: bool) -> str:
    """What Final.decode_path says: the runner's name (the GPU runners' names carry their mode),
    the reference runner's with `-dense` when it attended to every key."""
    return f"{runner}-dense" if dense and runner == "reference" else runner
