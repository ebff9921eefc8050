"""ArtifactWriter: one put of a context whose layers are handed over as a build finishes them.

    writer = store.writer(context_id, meta)
    writer.add_layer(i, layer, kv_codec, ready)   # per layer, as the build goes on (optional)
    manifest = writer.finish(artifact)            # the rest, then the manifest: READY
    writer.abort()                                # on any failure: nothing visible, nothing left

The object store's writer (object/object_writer.py) encodes and uploads each layer's chunks
while the build goes on; LMDB's (lmdb/stream_writer.py) encodes them and commits each hand-over
in its own short write transaction, the manifest last. Replacing an id that has a manifest,
LMDB uses `DeferredWriter`: everything at `finish`, in the one transaction that drops the old
chunks, so no reader sees a mix. `finish` stores whatever was not handed over (the
context-wide chunks, or every chunk when no layer was), so a writer given no layers is a put.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from ctxcache.artifact import ContextArtifact, LayerArtifact
from ctxcache.store.manifest import ContextMeta, Manifest

if TYPE_CHECKING:
    from ctxcache.store.lmdb.artifact_store import ArtifactStore


def landed() -> None:
    """`ready` for tensors already on the host."""
    return None


class ArtifactWriter(Protocol):
    def add_layer(self, index: int, layer: LayerArtifact, kv_codec: str,
                  ready: Callable[[], None] = landed) -> None:
        """Layer `index` of the artifact `finish` will get (the same tensors); `ready()` returns
        once its host tensors hold their data (a GPU build's copies are asynchronous). A layer
        may be handed over again as it fills (a build hands its K/V as its prefill ends, then the
        layer with its tables): chunks already handed over (the same tensors) are not stored twice."""

    def finish(self, artifact: ContextArtifact) -> Manifest:
        """Store the rest and commit; raises (after `abort`) if any part failed."""

    def abort(self) -> None:
        """Give the write up: no manifest, its stored chunks removed (idempotent)."""


class DeferredWriter:
    """LMDB's replacement of a stored id: one transaction (old chunks out, new in, manifest),
    so the layers wait for `finish`."""

    def __init__(self, store: "ArtifactStore", context_id: str, meta: ContextMeta) -> None:
        self.store, self.context_id, self.meta = store, context_id, meta

    def add_layer(self, index: int, layer: LayerArtifact, kv_codec: str,
                  ready: Callable[[], None] = landed) -> None:
        return None

    def finish(self, artifact: ContextArtifact) -> Manifest:
        return self.store.put(self.context_id, artifact, self.meta)

    def abort(self) -> None:
        return None
