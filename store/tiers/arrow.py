"""What the pyarrow.fs backends share: reads, listing and deletes on a pyarrow FileSystem.

pyarrow answers an absent path with FileNotFoundError on every filesystem; anything else it
raises (refused connection, timeout, a server error) becomes StoreUnavailable here.
"""

from __future__ import annotations

import concurrent.futures as cf
from typing import Any

from ctxcache.store.tiers.base import ObjectInfo, ObjectTier, TierConfig, check_key

# an object larger than this is read as ranges of it, in parallel: a 32 MB chunk from SeaweedFS
# came at 0.13 GB/s read as one stream and 0.59 GB/s as 8 MB ranges (2-core box, 24 chunks, 16 at
# a time); on an H200 host a 2.1 GB artifact read as whole objects came at 0.92 GB/s
RANGE_BYTES = 8 << 20
RANGE_THREADS = 32


class ArrowTier(ObjectTier):
    def __init__(self, uri: str, config: TierConfig, fs: Any, root: str) -> None:
        super().__init__(uri, config)
        self.fs, self.root = fs, root.rstrip("/")
        self._ranges = cf.ThreadPoolExecutor(RANGE_THREADS, f"tier-{self.scheme}-range")

    def path(self, key: str) -> str:
        return f"{self.root}/{check_key(key)}"

    def get(self, key: str) -> bytes | bytearray | None:
        try:
            with self.fs.open_input_file(self.path(key)) as f:
                size = f.size()
                return f.read() if size <= RANGE_BYTES else self._read_ranges(f, size)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise self.unavailable("get", key, exc) from None

    def close(self) -> None:
        self._ranges.shutdown(wait=False, cancel_futures=True)
        super().close()

    def _read_ranges(self, f: Any, size: int) -> bytearray:
        """The whole object through concurrent ranged reads of one handle (ReadAt is thread-safe)."""
        out = bytearray(size)
        view = memoryview(out)

        def part(offset: int) -> None:
            got = f.read_at(min(RANGE_BYTES, size - offset), offset)
            if len(got) != min(RANGE_BYTES, size - offset):
                raise OSError(f"short ranged read at {offset}: {len(got)} bytes")
            view[offset:offset + len(got)] = got

        for done in [self._ranges.submit(part, off) for off in range(0, size, RANGE_BYTES)]:
            done.result()
        return out

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
