"""A miss answered from its prefix's build before the store write lands.

A miss waits for its prefix's build (autocache.py) and is decoded over it as every later hit is.
It needs the built artifact, not the stored context: the build queue hands the artifact over
(Job.artifact) the moment the build ends, and the stream decodes from it while the write goes on
(on an H200 at 32K, 1.05 s of store write was left after a 3.27 s build). These are the bytes
the store keeps, so the answer is still a later hit's. The context stays what the write makes
it: READY (visible to others) once its manifest lands, FAILED with nothing left if the write
fails; an answer already given from the artifact stands. A fleet's remote build hands over no
artifact: its miss waits for READY and loads it, as before.

A runner keeps a context in a device slot by id, so a stream over an artifact whose write then
failed must not leave a slot matched to that id (a later build of the same id would be served
the old slot): `Unwritten` evicts it once both the stream and the write are over.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ctxcache.decoder.cached_context import CachedContext
from ctxcache.decoder.generate_streams import GenerateStreams
from ctxcache.decoder.stream_spec import Chunk, Final, GenerateSpec
from ctxcache.service.http.autocache import Registered
from ctxcache.service.rpc.calls import in_thread
from ctxcache.service.rpc.servicer import wait_for

log = logging.getLogger("ctxcache.service.http")
POLL_S = 0.01  # how often a waiting miss looks at its build (a coroutine: no thread is held)


@dataclass(frozen=True)
class Early:
    """A miss's prefix, ready to decode over: `context` is its build's artifact while the store
    write goes on (None: the context is READY; the decoder loads it as any other)."""

    made: Registered
    context: CachedContext | None = None


async def built(made: Registered | None) -> Early | None:
    """Wait for the build of a miss's prefix to end -> what to decode over; None if there is no
    prefix or its build failed (the prompt is then decoded alone, as a server with no cache would)."""
    if made is None:
        return None
    job = made.job
    handed = getattr(job, "built", None)  # a fleet's remote job hands no artifact over
    while job is not None and not job.done.is_set() and not (handed is not None and handed.is_set()):
        await asyncio.sleep(POLL_S)
    art = getattr(job, "artifact", None)
    if art is not None:  # (None again once the job is done: then it is READY or FAILED below)
        log.info("a miss decodes from the build of %s while its store write goes on", made.context_id[:12])
        return Early(made, CachedContext(art, job.spec.roles, 0))
    await wait_for(job)
    return Early(made) if job is None or job.state == "ready" else None


class Unwritten:
    """Decodes misses from unwritten artifacts; evicts a failed write's context from the runners."""

    def __init__(self, decoder: GenerateStreams, pool: ThreadPoolExecutor) -> None:
        self.decoder, self.pool = decoder, pool
        self._watching: set[asyncio.Task] = set()

    def stream(self, spec: GenerateSpec, alive: Callable[[], bool], t0: float,
               early: Early | None) -> Iterator[Chunk | Final]:
        """The decoder's stream (in a pool thread); over `early.context` if there is one."""
        context = early.context if early is not None else None
        try:
            yield from self.decoder.stream(spec, alive, None, t0, context)
        finally:
            if context is not None:
                self._evict_if_failed(early)  # the write failed while this stream held its slot

    def watch(self, early: Early | None) -> None:
        """On the event loop, for a stream over an unwritten artifact: evict once its write fails
        after the stream ended (the stream's end covers a write that failed before)."""
        if early is None or early.context is None:
            return
        task = asyncio.get_running_loop().create_task(self._after_write(early))
        self._watching.add(task)
        task.add_done_callback(self._watching.discard)

    async def _after_write(self, early: Early) -> None:
        await wait_for(early.made.job)
        await in_thread(self.pool, self._evict_if_failed, early)

    def _evict_if_failed(self, early: Early) -> None:
        job = early.made.job
        if job.done.is_set() and job.state != "ready" and self.decoder.evict_device(early.made.context_id):
            log.info("context %s: its write failed after a miss decoded from its build; its slot is released",
                     early.made.context_id[:12])
