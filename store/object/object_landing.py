"""A download from the object store handed over before it ends: its layers land as they arrive.

`fetch_landing` reads the manifest, lays out the artifact's host memory (ChunkDecoder) and returns
the artifact with its `landing` (ctxcache/landing.py) while the chunks are still being read; each
chunk is checked against the manifest, then decoded in place, then marked landed, on the thread
that read it (ObjectArtifactStore.fetch). A slot load copies layer i to the GPU once layer i has
landed (decoder/gpu/slot_load.py), so a cold load takes about the download, not the download
plus the slot load plus the question's prefill.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from ctxcache.artifact import ContextArtifact
from ctxcache.landing import Landing
from ctxcache.store.chunk_io import ChunkDecoder, Payload
from ctxcache.store.errors import StoreUnavailable
from ctxcache.store.layout import QUERY_CHUNK
from ctxcache.store.manifest import ChunkInfo, Manifest

log = logging.getLogger("ctxcache.store.object")

if TYPE_CHECKING:
    from ctxcache.store.object.object_store import Fetched, ObjectArtifactStore, SubsetSink


class LandingSink:
    """A SubsetSink that marks each decoded chunk landed once it is in place."""

    def __init__(self, inner: "SubsetSink", landing: Landing) -> None:
        self.inner, self.landing = inner, landing

    def target(self, i: int) -> memoryview | None:
        return self.inner.target(i)

    def put(self, i: int, buf: Payload) -> None:
        self.inner.put(i, buf)
        j = self.inner.position(i)
        if j is not None:
            self.landing.landed(j)


def fetch_landing(store: "ObjectArtifactStore", context_id: str, run: Callable[..., object],
                  then: Callable[["Fetched | BaseException"], None] = lambda _: None
                  ) -> tuple[ContextArtifact, Callable[[], None]] | None:
    """-> (the artifact with its `landing` set (the query chunks are fetched, not decoded),
    start: starts its download), or None if the context is absent. start() runs the download
    through run(fn, *args) (a pool's submit); then(what fetch gives, or its error) runs there
    once it has ended, before the landing is finished or failed. Any error of the download
    fails the landing (every later wait raises it). A write replaced or deleted while it lands
    fails it with StoreUnavailable: its layers may differ from those handed over already; a
    retry reads the new one."""
    from ctxcache.store.object.object_store import SubsetSink

    m = store.manifest(context_id)
    if m is None:
        return None
    wanted = [i for i, c in enumerate(m.chunks) if c.name != QUERY_CHUNK]
    dec = ChunkDecoder(m, [m.chunks[i] for i in wanted], store.codec.huge_pages, store.codec.pin_memory)
    landing = Landing([m.chunks[i].layer for i in wanted], m.n_layers)
    art = dec.artifact()
    art.landing = landing

    def sink(now: Manifest, chunks: tuple[ChunkInfo, ...]) -> LandingSink:
        if now is not m:
            raise StoreUnavailable(f"context {context_id} was replaced while it loaded; try again")
        return LandingSink(SubsetSink(dec, wanted), landing)

    def download() -> None:
        try:
            got: Fetched | BaseException = store.fetch(context_id, True, sink, first=m)
            if got is None:
                raise StoreUnavailable(f"context {context_id} was deleted while it loaded; try again")
        except BaseException as exc:  # noqa: BLE001 - every waiter raises it
            got = exc
        try:  # the bookkeeping first: a waiter that wakes sees it done
            then(got)
        except Exception:  # noqa: BLE001 - the landing must end whatever the bookkeeping does
            log.exception("after the download of %s", context_id[:12])
        finally:
            if isinstance(got, BaseException):
                landing.fail(got)
            else:
                landing.finish()

    def start() -> None:
        run(contextvars.copy_context().run, download)  # the request's deadline goes with it

    return art, start
