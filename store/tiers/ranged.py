"""Many objects read as ranges on one pool, object by object in the order given, into memory the
caller owns: a load's chunks come in layer order, so layer 0 lands first.

Each object is opened once, by whichever of its ranges runs first (pyarrow's S3 open is a HEAD:
the object's size, checked against the size the caller expects before anything is read); every
range is then a positional read on that handle (one ranged GET, no HEAD of its own). pyarrow
26's Python `open_input_file` takes only a path, so the size a manifest already knows cannot
spare that one HEAD per object (arrow's C++ OpenInputFile(FileInfo) can).

Before (one pool of object reads, each waiting on its ranges in a second pool) every 8 MB range
opened its own handle: a HEAD and a GET per range, and objects waiting on ranges held threads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

OpenFn = Callable[[str], Any]  # key -> an open pyarrow NativeFile; FileNotFoundError if absent


class ObjectRead:
    """One object's read: opened once, its ranges counted down; the last one to end reports."""

    def __init__(self, i: int, key: str, out: memoryview, n_ranges: int) -> None:
        self.i, self.key, self.out = i, key, out
        self._lock = threading.Lock()
        self._opened = False
        self._handle: Any = None
        self._error: OSError | None = None
        self.size: int | None = None  # the object's size; None: absent
        self._left = n_ranges

    def handle(self, open_fn: OpenFn) -> Any:
        """The open handle, or None when there is nothing to read (absent, or not the size
        expected: the caller is told the size and reads nothing)."""
        with self._lock:
            if not self._opened:
                try:
                    self._handle = open_fn(self.key)
                    self.size = self._handle.size()
                except FileNotFoundError:
                    self._handle, self.size = None, None
                except OSError as exc:  # the batch fails on it; its other ranges do not ask again
                    self._error = exc
                self._opened = True
            if self._error is not None:
                raise OSError(str(self._error))
            return self._handle if self.size == len(self.out) else None

    def gone(self) -> None:
        """Deleted between its open and a range's read: absent (the caller re-reads what names it)."""
        with self._lock:
            self.size = None

    def range_done(self) -> bool:
        """-> whether it was the last range (the handle is closed then)."""
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last and self._handle is not None:
            self._handle.close()
        return last


def read_range(obj: ObjectRead, offset: int, range_bytes: int, open_fn: OpenFn) -> bool:
    """obj.out[offset:offset + range_bytes] from the object -> whether it was obj's last range.
    OSError (other than an absent object) propagates for the tier to name."""
    try:
        f = obj.handle(open_fn)
        end = min(offset + range_bytes, len(obj.out))
        if f is not None and end > offset:
            if f.get_stream(offset, end - offset).readinto(obj.out[offset:end]) != end - offset:
                raise OSError(f"short ranged read at {offset} of {obj.key}")
    except FileNotFoundError:
        obj.gone()
    return obj.range_done()


def plan(keys: Sequence[str], outs: Sequence[memoryview], range_bytes: int
         ) -> tuple[list[ObjectRead], list[tuple[ObjectRead, int]]]:
    """-> (the objects, every (object, range offset) in the order given, object by object); an
    empty object is one range of nothing (its open says whether it is there)."""
    objs: list[ObjectRead] = []
    steps: list[tuple[ObjectRead, int]] = []
    for i, (key, out) in enumerate(zip(keys, outs, strict=True)):
        offsets = range(0, max(len(out), 1), range_bytes)
        objs.append(ObjectRead(i, key, out, len(offsets)))
        steps += [(objs[-1], off) for off in offsets]
    return objs, steps
