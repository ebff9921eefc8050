"""Artifact <-> (manifest, stored chunk bytes), shared by the LMDB store and the object tier.

Encoding happens once per put: the same payloads go to the object store and the local LMDB.
Decoding checks every chunk against the manifest (size, then checksum) before a byte of it is
used, so a damaged or truncated chunk raises CorruptArtifact (DATA_LOSS), never wrong data.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from concurrent.futures import Executor

import torch

from ctxcache.artifact import ContextArtifact
from ctxcache.store import codec
from ctxcache.store.arena import Arena
from ctxcache.store.config import StoreConfig
from ctxcache.store.errors import CorruptArtifact
from ctxcache.store.layout import Slot, assemble, build_manifest, chunk_tensors
from ctxcache.store.manifest import ChunkInfo, ContextMeta, Manifest

Payload = bytes | memoryview


def encode_artifact(context_id: str, art: ContextArtifact, meta: ContextMeta, config: StoreConfig,
                    pool: Executor, now: float) -> tuple[Manifest, list[Payload]]:
    """Encode every tensor (on the pool) -> the manifest and each chunk's stored bytes, in order."""
    stream = ChunkStream(context_id, art, chunk_tensors(art), meta, config, pool, now)
    payloads = [payload for _, payload in stream.payloads()]
    return stream.manifest(), payloads


class ChunkStream:
    """A put's chunks in store order, each encoding on the pool: a writer takes each payload
    as it is ready (`payloads`), then the manifest of them all."""

    def __init__(self, context_id: str, art: ContextArtifact, chunks: Sequence[tuple[Slot, torch.Tensor]],
                 meta: ContextMeta, config: StoreConfig, pool: Executor, now: float) -> None:
        self.context_id, self.art, self.meta, self.now = context_id, art, meta, now
        self.slots, self.tensors = zip(*chunks, strict=True)
        c = config
        self._futures = [pool.submit(codec.encode, t, c.zstd_level, c.min_gain, c.sample_bytes)
                         for t in self.tensors]

    def payloads(self) -> Iterator[tuple[Slot, Payload]]:
        for slot, future in zip(self.slots, self._futures, strict=True):
            yield slot, future.result().payload

    def manifest(self) -> Manifest:
        """Once every chunk is encoded (waits for the rest)."""
        enc = [f.result() for f in self._futures]
        return build_manifest(self.context_id, self.art, self.meta, self.slots, self.tensors, enc, self.now)


def raw_bytes(chunks: Sequence[tuple[Slot, torch.Tensor]]) -> int:
    """Bytes of the chunks as tensors: the most they take stored (codec.encode keeps a
    compressed or narrowed chunk only when it is smaller)."""
    return sum(t.numel() * t.element_size() for _, t in chunks)


def check_size(m: Manifest, info: ChunkInfo, size: int) -> None:
    """Raise CorruptArtifact unless the stored object's size is the manifest's."""
    if size != info.stored_bytes:
        raise CorruptArtifact(m.context_id, info.label(), f"stored size {size} != manifest {info.stored_bytes}")


def check_chunk(m: Manifest, info: ChunkInfo, buf: Payload | None, how: str) -> None:
    """Raise CorruptArtifact unless buf is exactly the chunk the manifest describes.
    how: xxh3 (fast, every load) | sha256 | none (sizes only)."""
    if buf is None:
        raise CorruptArtifact(m.context_id, info.label(), "chunk is missing")
    check_size(m, info, len(buf))
    if (how == "xxh3" and codec.fast_checksum(buf) != info.xxh3) or \
            (how == "sha256" and codec.checksum(buf) != info.sha256):
        raise CorruptArtifact(m.context_id, info.label(), f"{how} checksum mismatch")


class ChunkDecoder:
    """Some of m's chunks (in order) decoded into one arena as each arrives (`put`, from any
    thread: each chunk has its own range), then the artifact of them all."""

    def __init__(self, m: Manifest, chunks: Sequence[ChunkInfo], huge_pages: bool = False,
                 pin_memory: bool = False) -> None:
        try:
            specs = [(codec.torch_dtype(c.dtype), tuple(c.shape)) for c in chunks]
        except ValueError as exc:
            raise CorruptArtifact(m.context_id, "manifest", str(exc)) from None
        self.m, self.chunks = m, chunks
        self.arena = Arena(specs, huge_pages, pin_memory)
        self._in_place: set[int] = set()

    def target(self, i: int) -> memoryview | None:
        """Chunk i's tensor as bytes when its stored bytes are exactly those (a raw chunk of
        the tensor's own dtype), for a reader to fill in place: no copy. None: put() decodes."""
        info, t = self.chunks[i], self.arena.tensors[i]
        if info.codec != "raw" or info.stored_bytes != t.numel() * t.element_size() or t.numel() == 0 \
                or info.stored_dtype != codec.stored_name(t):
            return None
        self.arena.populate(i)
        self._in_place.add(i)
        return memoryview(t.view(-1).view(torch.uint8).numpy())

    def put(self, i: int, buf: Payload) -> None:
        """Decode chunk i's stored bytes (checked already) into its tensor (nothing to do for
        a chunk read in place)."""
        if i in self._in_place:
            return
        info = self.chunks[i]
        try:
            self.arena.populate(i)
            codec.decode_into(buf, self.arena.tensors[i], info.codec, info.stored_dtype)
        except ValueError as exc:
            raise CorruptArtifact(self.m.context_id, info.label(), str(exc)) from None

    def artifact(self) -> ContextArtifact:
        return assemble(self.m, self.chunks, self.arena.tensors)


def decode_chunks(m: Manifest, chunks: Sequence[ChunkInfo], bufs: Sequence[Payload | None], pool: Executor,
                  how: str, huge_pages: bool = False, pin_memory: bool = False) -> ContextArtifact:
    """Check and decode chunks (some of m's, in order) into one arena -> the artifact."""
    decoder = ChunkDecoder(m, chunks, huge_pages, pin_memory)

    def one(i: int) -> None:
        check_chunk(m, chunks[i], bufs[i], how)
        decoder.put(i, bufs[i])

    list(pool.map(one, range(len(chunks))))
    return decoder.artifact()
