"""ObjectTier: bytes by key on a shared object store (no torch, no artifacts).

Keys are relative to the tier's root (`bucket/prefix` or a directory), '/'-separated, e.g.
`v1/manifests/<id>`. The contract every backend keeps:
- `put` is atomic: a reader sees the old object, the whole new one, or nothing;
- an absent key is `None` / `False`, never an error;
- any other failure (refused connection, timeout, a server error) raises StoreUnavailable
  naming the URI, the operation and the key; batches give up after `deadline_s`.
Batches run on the tier's thread pool (the I/O releases the GIL), so a load of many chunks
costs about one round trip per `threads` chunks.
"""

from __future__ import annotations

import concurrent.futures as cf
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from ctxcache.store.errors import StoreUnavailable

T = TypeVar("T")
_KEY = re.compile(r"[A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-]+)*")


@dataclass(frozen=True)
class TierConfig:
    threads: int = 16  # concurrent requests of one batch
    # ranged reads in flight of a load's chunks (pyarrow tiers: one pool, chunks in order); 32
    # of 8 MB read 4.7 GB/s from SeaweedFS on an H200 host (16 cores), 64 of 4 MB 3.6
    read_threads: int = 32
    deadline_s: float = 30.0  # one batch (a whole artifact's chunks) must finish within this
    connect_timeout_s: float = 2.0  # S3: TCP connect
    request_timeout_s: float = 10.0  # S3: one request without progress
    max_attempts: int = 2  # S3: tries per request (the SDK's retries; keep the deadline bounded)

    def __post_init__(self) -> None:
        if self.threads < 1 or self.read_threads < 1 or self.max_attempts < 1:
            raise ValueError(f"threads={self.threads}, read_threads={self.read_threads} and "
                             f"max_attempts={self.max_attempts} must be >= 1")
        for name in ("deadline_s", "connect_timeout_s", "request_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")


@dataclass(frozen=True)
class ObjectInfo:
    key: str  # relative to the tier's root
    size: int
    mtime: float  # seconds since the epoch (the server's clock)


def check_key(key: str) -> str:
    if not isinstance(key, str) or not _KEY.fullmatch(key) or ".." in key.split("/"):
        raise ValueError(f"object key {key!r} must be '/'-separated parts of [A-Za-z0-9_.-]")
    return key


class ObjectTier(ABC):
    """One backend of the shared artifact tier; `open_tier(uri)` picks the class by scheme."""

    scheme: str = ""

    def __init__(self, uri: str, config: TierConfig) -> None:
        self.uri, self.config = uri, config
        self._pool: cf.ThreadPoolExecutor | None = cf.ThreadPoolExecutor(config.threads, f"tier-{self.scheme}")

    # ---- one object (backends implement these) ------------------------------------------------
    @abstractmethod
    def put(self, key: str, data: bytes | memoryview) -> None:
        """Store data under key, atomically replacing any object there."""

    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """The object's bytes, or None if absent."""

    @abstractmethod
    def contains(self, key: str) -> bool: ...

    @abstractmethod
    def delete(self, key: str) -> bool:
        """Remove key; True if it was there."""

    @abstractmethod
    def list(self, prefix: str) -> list[ObjectInfo]:
        """Every object whose key starts with `prefix` + '/', in key order."""

    @abstractmethod
    def delete_prefix(self, prefix: str) -> None:
        """Remove every object under `prefix` + '/' (S3: one listing and batched deletes)."""

    @abstractmethod
    def folders(self, prefix: str) -> list[ObjectInfo]:
        """The folders directly under `prefix` (size 0; mtime 0.0 where the store keeps none,
        as S3 does for the implicit folders of key prefixes)."""

    def sweep_partials(self, prefix: str, older_than: float) -> int:
        """Remove partial writes (a dead writer's temp files) modified before older_than; -> count.
        S3 has none visible: an upload is an object only once complete (a bucket lifecycle rule
        expires abandoned multipart uploads)."""
        return 0

    # ---- batches ------------------------------------------------------------------------------
    def put_many(self, items: Sequence[tuple[str, bytes | memoryview]]) -> None:
        self._batch("put", lambda kv: self.put(*kv), items)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """Every key's object (None: absent)."""
        return self._batch("get", self.get, keys)

    def get_into(self, key: str, out: memoryview) -> int | None:
        """Key's object read into out -> its size, out filled only when that is len(out) (a
        caller compares it with the size it expected); None if absent. Backends that can read
        into given memory override this copy."""
        data = self.get(key)
        if data is None:
            return None
        if len(data) == len(out):
            out[:] = data
        return len(data)

    def get_many_into(self, keys: Sequence[str], outs: Sequence[memoryview],
                      then: Callable[[int, int | None], None]) -> list[int | None]:
        """get_into for every key (out i for key i); then(i, size) runs on the worker that read
        key i as soon as it has (a load checks and decodes each chunk while the others arrive)."""
        def one(i: int) -> int | None:
            size = self.get_into(keys[i], outs[i])
            then(i, size)
            return size
        return self._batch("get", one, range(len(keys)))

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        return self._batch("contains", self.contains, keys)

    def delete_many(self, keys: Sequence[str]) -> int:
        return sum(self._batch("delete", self.delete, keys))

    def _batch(self, op: str, fn: Callable[[T], object], items: Sequence[T]) -> list:
        if self._pool is None:
            raise StoreUnavailable(f"object store {self.uri} is closed")
        return self.wait_all(op, [self._pool.submit(fn, it) for it in items], len(items))

    def wait_all(self, op: str, futures: Sequence[cf.Future], n_objects: int) -> list:
        """Every future's result within deadline_s; the first error, or StoreUnavailable past the
        deadline, cancels those not started and is raised."""
        done, pending = cf.wait(futures, timeout=self.config.deadline_s, return_when=cf.FIRST_EXCEPTION)
        for f in done:
            if f.exception() is not None:
                for p in pending:
                    p.cancel()
                raise f.exception()
        if pending:
            for p in pending:
                p.cancel()
            raise StoreUnavailable(f"object store {self.uri}: {op} of {n_objects} objects did not finish "
                                   f"within {self.config.deadline_s:g} s ({len(pending)} outstanding)")
        return [f.result() for f in futures]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self._pool = None

    def unavailable(self, op: str, key: str, exc: BaseException) -> StoreUnavailable:
        why = " ".join(str(exc).split())[:300]
        return StoreUnavailable(f"object store {self.uri}: {op} {key}: {why}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"
