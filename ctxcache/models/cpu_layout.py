"""The CPU decode step: each Linear weight [out, in] stored input-major; threads from the cores.

A decode step multiplies one row per stream by every weight: a matrix-vector product, whose
speed on the CPU depends on the layout. With the [out, in] layout torch's CPU BLAS computes a
dot product per output (a horizontal sum each); stored as [in, out] (the same values, the
parameter a transposed view of it, so every caller and the state dict see [out, in]) it runs
as scaled column adds over contiguous outputs. On this project's 2-core AMD EPYC box (Zen 4)
150 SmolLM2-shaped (1536 x 576) fp32 products took 52 ms as [out, in] and 31-34 ms as
[in, out]: the weights are most of a 4K-token decode step in both modes. The sums are taken in
another order, so logits may differ in the last bits (greedy tokens did not: tests/core/
test_cpu_decode_step.py).
"""

from __future__ import annotations

import os

import torch
from torch import nn


def input_major(model: nn.Module) -> nn.Module:
    """Relayout every nn.Linear weight of a CPU model in place (tied weights once: an
    embedding that shares the head's weight gathers rows of the transposed view, strided)."""
    done: set[int] = set()
    for module in model.modules():
        if not isinstance(module, nn.Linear) or module.weight.device.type != "cpu":
            continue
        w = module.weight
        if id(w) in done or w.dim() != 2 or w.stride(0) == 1:
            continue
        w.data = w.data.t().contiguous().t()
        done.add(id(w))
    return model


def usable_cores() -> int:
    """torch threads for a server by default: torch's own count (the machine's physical cores),
    capped by the cores this process may run on (its affinity: a container's or taskset's
    share): more threads than cores make every parallel op wait on a descheduled thread (on
    this box a 2-thread 4K dense step took 0.09 s alone, 0.83 s with the cores busy elsewhere)."""
    try:
        allowed = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this OS
        allowed = os.cpu_count() or 1
    return max(1, min(torch.get_num_threads(), allowed))
