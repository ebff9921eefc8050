"""A miss answered from its prefix's build before the store write lands.

A miss waits for its prefix's build (autocache.py) and is decoded over it as every later hit is.
It needs the built artifact, not the stored context: the build queue hands the artifact over
(Job.artifact) the moment the build ends, and the stream decodes from it while the write goes on
(on an H200 at 32K, 1.05 s of store write was left after a 3.27 s build). These are the bytes
the store keeps, so the answer is still a later hit's. The context stays what the write makes
it: READY (visible to others) once its manifest lands, FAILED with nothing left if the write
fails; an answer already given from the artifact stands. A fleet's remote build hands over no
artifact: its miss waits for READY and loads it, as before.

Once the write ends, `Unwritten` settles what the stream left: stored, the artifact goes to the
decoder's DRAM cache as a load would have put it (the first hit then starts from DRAM, or from
the device slot the miss left, instead of loading it back); failed, the runners drop any slot
matched to that id (a later build of the same id must not be served the old slot), once both
the stream and the write are over.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from ctxcache.decoder.cached_context import CachedContext
from ctxcache.decoder.generate_streams import GenerateStreams
from ctxcache.decoder.stream_spec import Chunk, Final, GenerateSpec
from ctxcache.service.http.autocache import Registered
from ctxcache.service.rpc.calls import in_thread
from ctxcache.service.rpc.servicer import wait_for
from ctxcache.store import Manifest

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
    """Decodes misses from unwritten artifacts; settles each once its write ends."""

    def __init__(self, decoder: GenerateStreams, pool: ThreadPoolExecutor,
                 manifest: Callable[[str], Manifest | None]) -> None:
        """manifest: the store's, by context id (None: not stored)."""
        self.decoder, self.pool, self.manifest = decoder, pool, manifest
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
        """On the event loop, for a stream over an unwritten artifact: settle it once its write
        ends (a write that failed before the stream ended is covered by the stream's end too)."""
        if early is None or early.context is None:
            return
        task = asyncio.get_running_loop().create_task(self._after_write(early))
        self._watching.add(task)
        task.add_done_callback(self._watching.discard)

    async def _after_write(self, early: Early) -> None:
        await wait_for(early.made.job)
        await in_thread(self.pool, self._settle, early)

    def _settle(self, early: Early) -> None:
        cid = early.made.context_id
        try:
            if early.made.job.state != "ready":
                self._evict_if_failed(early)
            elif (m := self.manifest(cid)) is not None and early.context is not None:
                context = replace(early.context, stored_bytes=m.stored_bytes)
                self.decoder.adopt(cid, context, lambda: self.manifest(cid) is not None)
        except Exception:  # noqa: BLE001 - a hint: the next stream of it loads it as any other
            log.exception("context %s: settling a miss decoded from its build failed", cid[:12])

    def _evict_if_failed(self, early: Early) -> None:
        job = early.made.job
        if job.done.is_set() and job.state != "ready" and self.decoder.evict_device(early.made.context_id):
            log.info("context %s: its write failed after a miss decoded from its build; its slot is released",
                     early.made.context_id[:12])
