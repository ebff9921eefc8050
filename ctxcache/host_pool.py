"""One page-locked host pool, registered once at start; loaded artifacts are carved out of it.

Why: on an H200, a 32K artifact's LMDB load (2.1 GB) spent 0.84 of ~1.0 s in cudaHostRegister
of a fresh mapping (its pages faulted in and locked on every load); checking and copying the
same bytes on 16 threads took ~0.1 s (xxh3 46 GB/s, copy into pinned memory 41 GB/s). So the
server page-locks one mapping at start (`serve --host-pool-gb`, the DRAM cache lives in it) and
each load takes a contiguous range of it: no registration, no page faults, no allocation on the
load path. A range goes back when the last tensor viewing it is gone (as a page-locked arena's
mapping did), so eviction frees ranges, not mappings.

Ranges are first-fit over a free list kept sorted by offset and merged on release (no torch
here: `Ranges` is plain bookkeeping). A load that finds no room gets None and falls back to
a mapping of its own.
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import mmap
import threading
import weakref

from ctxcache.page_lock import page_lock

log = logging.getLogger("ctxcache.host_pool")
ALIGN = 1 << 12  # every range starts on a page, as an arena's chunks do


class Ranges:
    """First-fit allocation of [offset, offset + size) ranges in [0, capacity)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity={capacity} must be >= 0")
        self.capacity = capacity
        self._starts: list[int] = [0] if capacity else []  # free ranges, sorted by start
        self._sizes: dict[int, int] = {0: capacity} if capacity else {}
        self.used = 0

    def take(self, size: int) -> int | None:
        """-> the offset of a free range of `size` bytes (rounded up to ALIGN), or None."""
        size = -(-max(size, 1) // ALIGN) * ALIGN
        for i, start in enumerate(self._starts):
            have = self._sizes[start]
            if have >= size:
                del self._starts[i], self._sizes[start]
                if have > size:
                    self._insert(start + size, have - size)
                self.used += size
                return start
        return None

    def give(self, offset: int, size: int) -> None:
        """Return a range `take` gave (same size asked): merged with free neighbours."""
        size = -(-max(size, 1) // ALIGN) * ALIGN
        self.used -= size
        i = bisect.bisect_left(self._starts, offset)
        if i < len(self._starts) and offset + size == self._starts[i]:  # merge the next
            nxt = self._starts.pop(i)
            size += self._sizes.pop(nxt)
        if i > 0 and self._starts[i - 1] + self._sizes[self._starts[i - 1]] == offset:  # and the previous
            prev = self._starts[i - 1]
            self._sizes[prev] += size
            return
        self._insert(offset, size)

    def _insert(self, start: int, size: int) -> None:
        bisect.insort(self._starts, start)
        self._sizes[start] = size

    def largest_free(self) -> int:
        return max(self._sizes.values(), default=0)


class HostPool:
    """A page-locked mapping of `capacity` bytes; `block(n)` -> a ctypes array over n bytes of
    it (None when no contiguous range is free), returned to the pool when the array is gone."""

    def __init__(self, capacity: int) -> None:
        self._buf = mmap.mmap(-1, max(capacity, ALIGN), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._locked = page_lock(self._buf)  # raises MemoryError when the pages cannot be locked
        self._ranges = Ranges(len(self._buf))
        self._lock = threading.Lock()

    @property
    def capacity(self) -> int:
        return self._ranges.capacity

    @property
    def used(self) -> int:
        return self._ranges.used

    def block(self, size: int) -> ctypes.Array | None:
        with self._lock:
            offset = self._ranges.take(size)
        if offset is None:
            return None
        view = (ctypes.c_ubyte * max(size, 1)).from_buffer(self._locked, offset)
        weakref.finalize(view, self._give, offset, size)
        return view

    def _give(self, offset: int, size: int) -> None:
        with self._lock:
            self._ranges.give(offset, size)


_pool: HostPool | None = None


def install(capacity: int) -> HostPool | None:
    """Page-lock the process's pool (once, at start); -> it, or None with one logged line when
    the memory cannot be locked."""
    global _pool
    try:
        _pool = HostPool(capacity)
    except MemoryError as exc:
        log.warning("no page-locked host pool (%s): loads run unpinned, their copies to the GPU slower", exc)
        _pool = None
    return _pool


def installed() -> HostPool | None:
    return _pool


def uninstall() -> None:
    global _pool
    _pool = None
