"""What the pyarrow.fs backends share: reads, listing and deletes on a pyarrow FileSystem.

pyarrow answers an absent path with FileNotFoundError on every filesystem; anything else it
raises (refused connection, timeout, a server error) becomes StoreUnavailable here.
"""

from __future__ import annotations

from typing import Any

from ctxcache.store.tiers.base import ObjectInfo, ObjectTier, TierConfig, check_key


class ArrowTier(ObjectTier):
    def __init__(self, uri: str, config: TierConfig, fs: Any, root: str) -> None:
        super().__init__(uri, config)
        self.fs, self.root = fs, root.rstrip("/")

    def path(self, key: str) -> str:
        return f"{self.root}/{check_key(key)}"

    def get(self, key: str) -> bytes | None:
        try:
            with self.fs.open_input_stream(self.path(key)) as f:
                return f.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise self.unavailable("get", key, exc) from None

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
