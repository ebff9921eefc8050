"""What the pyarrow.fs backends share: reads, listing and deletes on a pyarrow FileSystem.

pyarrow answers an absent path with FileNotFoundError on every filesystem; anything else it
raises (refused connection, timeout, a server error) becomes StoreUnavailable here.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ctxcache.store.errors import StoreUnavailable
from ctxcache.store.tiers import ranged
from ctxcache.store.tiers.base import ObjectInfo, ObjectTier, TierConfig, check_key

# an object larger than this is read as ranges of it, in parallel: a 32 MB chunk from SeaweedFS
# came at 0.13 GB/s read as one stream and 0.59 GB/s as 8 MB ranges (2-core box, 24 chunks, 16 at
# a time). On an H200 host (2.2 GB: 64 objects of 32 MB and 64 of 1 MB, SeaweedFS on the same
# machine) ranges of one shared handle came at 1.0 GB/s, most of the GIL's time spent zeroing a
# fresh bytearray per object; one handle per 8 MB range read into memory given by the caller
# (`get_into`) at 4.7 GB/s, 16 MB ranges 4.0, 4 MB ranges on 64 threads 3.6, whole objects 3.3.
# Now one handle per object, each range a positional read on it (ranged.py: no HEAD per range)
RANGE_BYTES = 8 << 20


class ArrowTier(ObjectTier):
    def __init__(self, uri: str, config: TierConfig, fs: Any, root: str) -> None:
        super().__init__(uri, config)
        self.fs, self.root = fs, root.rstrip("/")
        self._ranges = cf.ThreadPoolExecutor(config.read_threads, f"tier-{self.scheme}-range")

    def path(self, key: str) -> str:
        return f"{self.root}/{check_key(key)}"

    def get(self, key: str) -> bytes | memoryview | None:
        try:
            with self.fs.open_input_file(self.path(key)) as f:
                size = f.size()
                if size <= RANGE_BYTES:
                    return f.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise self.unavailable("get", key, exc) from None
        for _ in range(3):  # a large object, in ranges: again at its new size if it was replaced meanwhile
            out = memoryview(np.empty(size, np.uint8))
            got = self.get_into(key, out)
            if got is None or got == size:
                return None if got is None else out
            size = got
        raise self.unavailable("get", key, OSError("the object kept changing size while it was read"))

    def open_object(self, key: str) -> Any:
        """key's handle for positional reads (pyarrow NativeFile; S3: one HEAD, which gives its
        size); FileNotFoundError if absent."""
        return self.fs.open_input_file(self.path(key))

    def get_into(self, key: str, out: memoryview) -> int | None:
        """Read key's object straight into out, in ranges in parallel -> the object's size (out
        is filled only when that is len(out)); None if absent."""
        return self.get_many_into([key], [out], lambda i, size: None)[0]

    def get_many_into(self, keys: Sequence[str], outs: Sequence[memoryview],
                      then: Callable[[int, int | None], None]) -> list[int | None]:
        """Every object's ranges on one pool, object by object in the order given (ranged.py);
        then(i, size) on the thread that read object i's last range."""
        if self._pool is None:
            raise StoreUnavailable(f"object store {self.uri} is closed")
        objs, steps = ranged.plan(keys, outs, RANGE_BYTES)

        def one(obj: ranged.ObjectRead, offset: int) -> None:
            try:
                last = ranged.read_range(obj, offset, RANGE_BYTES, self.open_object)
            except OSError as exc:
                raise self.unavailable("get", obj.key, exc) from None
            if last:
                then(obj.i, obj.size)

        self.wait_all("get", [self._ranges.submit(one, obj, off) for obj, off in steps], len(objs))
        return [obj.size for obj in objs]

    def close(self) -> None:
        self._ranges.shutdown(wait=False, cancel_futures=True)
        super().close()

    def contains(self, key: str) -> bool:
        from pyarrow.fs import FileType

        try:
            return self.fs.get_file_info(self.path(key)).type == FileType.File
        except OSError as exc:
            raise self.unavailable("contains", key, exc) from None

    def delete(self, key: str) -> bool:
        try:
            self.fs.delete_file(self.path(key))
            return True
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise self.unavailable("delete", key, exc) from None

    def delete_prefix(self, prefix: str) -> None:
        try:
            self.fs.delete_dir(self.path(prefix))
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise self.unavailable("delete_prefix", prefix, exc) from None

    def folders(self, prefix: str) -> list[ObjectInfo]:
        from pyarrow.fs import FileSelector, FileType

        try:
            infos = self.fs.get_file_info(FileSelector(self.path(prefix), allow_not_found=True))
        except OSError as exc:
            raise self.unavailable("folders", prefix, exc) from None
        cut = len(self.root) + 1
        return sorted((ObjectInfo(i.path[cut:], 0, i.mtime.timestamp() if i.mtime else 0.0)
                       for i in infos if i.type == FileType.Directory), key=lambda o: o.key)

    def list(self, prefix: str) -> list[ObjectInfo]:
        from pyarrow.fs import FileSelector, FileType

        base = self.path(prefix)
        try:
            infos = self.fs.get_file_info(FileSelector(base, allow_not_found=True, recursive=True))
        except OSError as exc:
            raise self.unavailable("list", prefix, exc) from None
        cut = len(self.root) + 1
        out = [ObjectInfo(i.path[cut:], i.size, i.mtime.timestamp() if i.mtime else 0.0)
               for i in infos if i.type == FileType.File and self.listed(i.path[cut:])]
        return sorted(out, key=lambda o: o.key)

    def listed(self, key: str) -> bool:
        """Whether a file under the root is an object (FileTier hides its temp files)."""
        return True
