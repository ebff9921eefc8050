"""FileTier: a shared filesystem (NFS, a mounted volume, a local disk) through pyarrow's
LocalFileSystem. URI: `file:///absolute/path`.

A put writes `<key>.~tmp.<random>` and renames it onto the key: rename is atomic on POSIX, so a
reader sees the old object or the whole new one. `~` is outside the key alphabet, so temp
files are never listed as objects; `sweep_partials` removes those a crashed writer left (GC).
"""

from __future__ import annotations

import os
import secrets
from urllib.parse import unquote, urlsplit

from ctxcache.store.tiers.arrow import ArrowTier
from ctxcache.store.tiers.base import TierConfig

TEMP_MARK = ".~tmp."


def parse_file_uri(uri: str) -> str:
    u = urlsplit(uri)
    path = unquote(u.path)
    if u.scheme != "file" or u.netloc not in ("", "localhost") or u.query or not os.path.isabs(path):
        raise ValueError(f"object store URI {uri!r} must be file:///absolute/path (no host, no options)")
    return os.path.normpath(path)


class FileTier(ArrowTier):
    scheme = "file"

    def __init__(self, uri: str, config: TierConfig = TierConfig()) -> None:
        from pyarrow import fs

        root = parse_file_uri(uri)
        super().__init__(uri, config, fs.LocalFileSystem(), root)

    def put(self, key: str, data: bytes | memoryview) -> None:
        path = self.path(key)
        tmp = f"{path}{TEMP_MARK}{secrets.token_hex(6)}"
        try:
            try:
                self._write(path, tmp, data)
            except FileNotFoundError:  # a delete_prefix removed the folder just now: once more
                self._write(path, tmp, data)
        except OSError as exc:
            try:
                self.fs.delete_file(tmp)
            except OSError:
                pass
            raise self.unavailable("put", key, exc) from None

    def _write(self, path: str, tmp: str, data: bytes | memoryview) -> None:
        self.fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
        with self.fs.open_output_stream(tmp) as f:
            f.write(data)
        self.fs.move(tmp, path)

    def listed(self, key: str) -> bool:
        return TEMP_MARK not in key

    def sweep_partials(self, prefix: str, older_than: float) -> int:
        """Delete temp files of writers that died before their rename, modified before
        older_than; -> how many."""
        from pyarrow.fs import FileSelector, FileType

        try:
            infos = self.fs.get_file_info(FileSelector(self.path(prefix), allow_not_found=True, recursive=True))
        except OSError as exc:
            raise self.unavailable("sweep", prefix, exc) from None
        stale = [i.path for i in infos if i.type == FileType.File and TEMP_MARK in i.path
                 and i.mtime.timestamp() < older_than]
        for path in stale:
            try:
                self.fs.delete_file(path)
            except FileNotFoundError:
                pass  # a concurrent sweep removed it first
        return len(stale)
