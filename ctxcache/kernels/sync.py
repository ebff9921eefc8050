"""Programmatic dependent launch (Hopper+) between the decode step's kernels; off under the
CPU interpreter (it runs programs one after another and cannot execute inline PTX).

A kernel launched with `launch_pdl=True` may start while its predecessor drains; `pdl_wait()`
blocks until the predecessor finished and its writes are visible. Every kernel that uses it
calls `pdl_wait()` before touching memory its predecessors write, so the overlap only hides
launch latency, never a dependency. A kernel may read earlier what was written before the
step's first launch (the row lengths, q): each kernel of the chain lets its successor start only
after its own wait returned, so when a kernel starts, everything two launches back and earlier
has finished. The selection's and the attention's launches do (`pre_wait`): the route its
centroids, the int8 score kernel and the radix passes their row lengths, the split-K attention
n, k and q (H100: ~0.4 us per 128K step for the last two); the merge lets its successor launch
once its own wait returned, so the next layer's route can read early.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def pdl_available(device: torch.device | str) -> bool:
    """Compiled code on a Hopper-or-newer GPU (griddepcontrol needs sm_90), unless
    CTXCACHE_NO_PDL=1: a profile then times each kernel alone (with PDL a kernel's span includes
    its wait for the one before, as the split-K merge's did)."""
    dev = torch.device(device)
    return (not INTERPRET and os.environ.get("CTXCACHE_NO_PDL") != "1" and dev.type == "cuda"
            and torch.cuda.is_available() and torch.cuda.get_device_capability(dev)[0] >= 9)


def compiled(t: torch.Tensor) -> bool:
    """True where kernels on t run compiled (PDL and inline PTX exist there)."""
    return t.is_cuda and not INTERPRET


def launch_opts(pdl: bool) -> dict:
    """Extra launch keywords: only compiled launches know `launch_pdl`."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """A kernel's first statement: wait for the predecessor, then let the successor launch
    (it waits for this kernel in turn before touching memory)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
