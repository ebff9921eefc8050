"""Garbage collection in a serving process. What is alive once the runners are warm (modules,
the model's Python objects, the tokenizer) is frozen: no later collection scans it again, so a
full collection costs what serving allocated since, not the whole heap, and every thread (the
decode loop's too) stops for less; a stopped server thaws it (thaw). A collection slower than
SLOW_GC_S is logged, so a stall in a stream's inter-token gaps can be matched to one."""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)
SLOW_GC_S = 0.01


def freeze_and_watch() -> None:
    """Freeze what is alive now; the first call also installs the timing callback."""
    gc.freeze()
    if any(getattr(cb, "ctxcache_gc_watch", False) for cb in gc.callbacks):
        return
    started: list[float] = []

    def timed(phase: str, info: dict) -> None:
        if phase == "start":
            started[:] = [time.perf_counter()]
        elif started and (took := time.perf_counter() - started.pop()) > SLOW_GC_S:
            log.info("slow gc: %.0f ms (generation %d, %d collected, %d frozen)", 1e3 * took,
                     info["generation"], info["collected"], gc.get_freeze_count())

    timed.ctxcache_gc_watch = True
    gc.callbacks.append(timed)


def thaw() -> None:
    """Give what freeze_and_watch froze back to the collector: a stopped server's own objects
    (its loop, servicers and runners in reference cycles) were frozen with it, and a second
    server in the same process (the GPU serving tests) ran out of HBM beside the first's."""
    gc.unfreeze()
