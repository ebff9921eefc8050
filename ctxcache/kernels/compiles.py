"""Counts Triton kernel compilations in this process, so a server can prove it compiles nothing
while serving (every kernel specialization is built during warm-up, before SERVING)."""

from __future__ import annotations

import logging
import threading

import triton

_log = logging.getLogger(__name__)


class CompileCounter:
    """Triton's jit_cache_hook runs once for each kernel specialization new to the process (a
    miss of the in-memory kernel cache, whether or not the disk cache then holds the binary)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.total = 0
        self.at_ready: int | None = None
        self.names: list[str] = []  # kernels compiled after ready(), for the log

    @classmethod
    def install(cls) -> "CompileCounter":
        """Chain onto the hook already installed (if any); the counter never skips a compile."""
        counter = cls()
        runtime = triton.knobs.runtime
        previous = runtime.jit_cache_hook

        def hook(*args, **kwargs):
            counter._count(kwargs.get("fn"))
            return previous(*args, **kwargs) if previous is not None else False
        runtime.jit_cache_hook = hook
        return counter

    def _count(self, fn) -> None:
        with self._lock:
            self.total += 1
            if self.at_ready is not None:
                self.names.append(getattr(fn, "name", str(fn)))
                _log.warning("Triton compiled %s after warm-up (a shape the warm-up did not build)", self.names[-1])

    def ready(self) -> None:
        with self._lock:
            self.at_ready = self.total

    def after_ready(self) -> int:
        """Compilations since ready() (0 before it)."""
        with self._lock:
            return 0 if self.at_ready is None else self.total - self.at_ready


def report_compiles(write) -> None:
    """Call write("start NAME") before Triton compiles each kernel specialization new to the process
    and write("done NAME") once it is built, chained onto the hooks already installed: a process
    that dies inside the compiler leaves the kernel it was compiling as its last "start" line."""
    runtime = triton.knobs.runtime
    before, after = runtime.jit_cache_hook, runtime.jit_post_compile_hook

    def start(*args, **kwargs):
        write(f"start {_name(kwargs.get('fn'))}")
        return before(*args, **kwargs) if before is not None else False

    def done(*args, **kwargs):
        write(f"done {_name(kwargs.get('fn'))}")
        return after(*args, **kwargs) if after is not None else None
    runtime.jit_cache_hook, runtime.jit_post_compile_hook = start, done


def _name(fn) -> str:
    return " ".join(str(getattr(fn, "name", fn)).split()) or "?"  # a line of the report each
