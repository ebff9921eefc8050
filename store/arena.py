"""One anonymous memory mapping per loaded artifact, advised to use transparent huge pages.

Why: filling freshly allocated memory costs more than the copy itself on this box (4 KiB page
faults: copying 300 MB into a new torch.empty took 0.34 s vs 0.07 s into touched memory).
With MADV_HUGEPAGE + MADV_POPULATE_WRITE (Linux >= 5.14) a 660 MB mapping is faulted in
about 0.11 s, and each chunk's range is populated by the thread that then fills it, so the
kernel's page zeroing runs on both cores. Tensors are views of the mapping (`torch.frombuffer`
keeps it alive), so it is unmapped when the last tensor is gone.

Huge pages are off by default (`StoreConfig.huge_pages`): re-measured with a 4K-token SmolLM2
artifact (830 MB) on this 2-core box, the *first* load into THP-advised memory took 1.76 to
1.82 s (the kernel compacts memory to find huge pages; THP defrag is `madvise` here), later
ones 0.14 s; plain 4 KiB pages load in 0.22 to 0.26 s every time, and populating them
without THP took 0.31 s. A cold load is what a cache miss pays, so predictability wins.

Pinned arenas (for a GPU server's async copies) are a range of the server's page-locked host
pool (ctxcache.host_pool), given back when the last tensor is gone; without a pool, or when it has
no room, the same anonymous mapping page-locked for exactly its size (ctxcache/page_lock.py), which
costs a registration and page faults per load (0.84 s of a 2.1 GB load on an H200).
"""

from __future__ import annotations

import logging
import mmap

import torch

from ctxcache import host_pool
from ctxcache.page_lock import page_lock

log = logging.getLogger("ctxcache.store.arena")
_ALIGN = mmap.PAGESIZE  # chunk ranges start on a page so each can be populated on its own
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Python 3.11 lacks the name


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class Arena:
    """Uninitialised contiguous tensors for (dtype, shape) specs, backed by one mapping."""

    def __init__(self, specs: list[tuple[torch.dtype, tuple[int, ...]]],
                 huge_pages: bool = True, pinned: bool = False) -> None:
        """pinned: page-locked memory (CUDA's host allocator) instead of a mapping, so a GPU
        runner's copies of these tensors to HBM run asynchronously at PCIe speed."""
        sizes = [_numel(s) * torch.empty(0, dtype=dt).element_size() for dt, s in specs]
        self._ranges: list[tuple[int, int]] = []
        total = sum(_aligned(n) for n in sizes)
        self._populate = huge_pages and not pinned  # pinned pages are resident already
        source = _pool_block(total) if pinned else None
        self.pooled = source is not None
        if source is None:
            self._buf = mmap.mmap(-1, max(total, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            source = page_lock(self._buf) if pinned else self._buf
            if huge_pages and not pinned and hasattr(mmap, "MADV_HUGEPAGE"):
                self._buf.madvise(mmap.MADV_HUGEPAGE)
        self.tensors: list[torch.Tensor] = []
        offset = 0
        for (dt, shape), n in zip(specs, sizes):
            self._ranges.append((offset, _aligned(n)))
            if n == 0:
                self.tensors.append(torch.empty(shape, dtype=dt))
                continue
            self.tensors.append(torch.frombuffer(source, dtype=dt, count=_numel(shape), offset=offset).view(shape))
            offset += _aligned(n)

    def populate(self, i: int) -> None:
        """Fault in tensor i's pages in one syscall (no-op where unsupported)."""
        start, length = self._ranges[i]
        if not self._populate or length == 0:
            return
        try:
            self._buf.madvise(_MADV_POPULATE_WRITE, start, length)
        except OSError:
            self._populate = False  # older kernel: pages fault in on first write instead


def _pool_block(size: int):  # noqa: ANN202 (a ctypes array or None)
    pool = host_pool.installed()
    if pool is None or size == 0:
        return None
    block = pool.block(size)
    if block is None:
        log.warning("host pool has no free range of %.2f GiB (%.2f of %.2f GiB in use): this load locks its "
                    "own memory (serve --host-pool-gb)", size / 2**30, pool.used / 2**30, pool.capacity / 2**30)
    return block
