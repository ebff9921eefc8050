"""Device -> host copies for artifacts built on a GPU.

A pageable device-to-host copy ran at about 1.5 GB/s on the H100 (83% of PutContext's index
time at 8K tokens); into pinned memory it runs at PCIe speed and asynchronously, so the build
queues every copy and waits once (`wait_for_host_copies`) before the artifact is read.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Callable

import torch

from ctxcache.page_lock import page_lock


def to_host(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`t` (cast to `dtype` first, on its device) on the host: pinned and not yet waited for
    when `t` is on a GPU; a plain CPU tensor otherwise."""
    if dtype is not None:
        t = t.to(dtype)
    if not t.is_cuda:
        return t.cpu()
    out = _pool_tensor(t.shape, t.dtype)
    if out is None:
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return out.copy_(t, non_blocking=True)


def _pool_tensor(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor | None:
    """An uninitialised host tensor in the process's page-locked pool (ctxcache.host_pool), or
    None without one or without room. Why: torch's pinned allocator calls cudaHostAlloc for
    every new block size, and a 32K PutContext's 2.1 GB of codes spent 1.6 s there on an H200
    (its build took 3.9 s for a 1.8 s prefill); a pool range is locked already."""
    from ctxcache import host_pool

    pool = host_pool.installed()
    n = math.prod(shape)
    nbytes = n * torch.empty(0, dtype=dtype).element_size()
    block = pool.block(nbytes) if pool is not None and nbytes > 0 else None
    if block is None:
        return None
    return torch.frombuffer(block, dtype=dtype, count=n).view(shape)


def host_copies_mark(device: torch.device) -> Callable[[], None]:
    """A wait, callable from any thread, that returns once every copy `to_host` has queued on
    `device`'s current stream so far has landed (a CUDA event; nothing to wait for on the CPU):
    a store writer encodes a finished layer's host tensors while the build goes on."""
    if device.type != "cuda":
        return _landed
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event.synchronize


def _landed() -> None:
    return None


def wait_for_host_copies(device: torch.device) -> None:
    """Every copy `to_host` queued on `device`'s current stream has landed."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def pinned_exact(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed host tensor page-locked for exactly its bytes where CUDA is (see page_lock); a
    plain CPU tensor elsewhere."""
    if not torch.cuda.is_available():
        return torch.zeros(shape, dtype=dtype)
    n = math.prod(shape)
    buf = mmap.mmap(-1, max(n * torch.empty(0, dtype=dtype).element_size(), 1),
                    flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # anonymous pages are zero
    return torch.frombuffer(page_lock(buf), dtype=dtype, count=n).view(shape)
