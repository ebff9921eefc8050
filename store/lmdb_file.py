"""LMDB's data file checked against its own meta pages, so a short file is an error, not SIGBUS.

LMDB maps data.mdb and reads pages through the mapping: a page past the end of a truncated
file is a SIGBUS that kills the whole process (and every client's stream with it). The two
meta pages at the start of the file name the last page in use; a file shorter than
(last page + 1) x page size is truncated. Checked before opening and again before each read
transaction (one fstat), so a file cut while the server runs answers DATA_LOSS instead.

Meta page layout (lmdb.h / mdb.c, 64-bit): a 16-byte page header, then MDB_meta: magic u32,
version u32, address u64, mapsize u64, two MDB_db of 48 bytes (the first one's leading u32
is the page size), last_pg u64, txnid u64.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

from ctxcache.store.errors import StoreError

MAGIC = 0xBEEFC0DE
_HDR = 16
_META = struct.Struct("<IIQQ")  # magic, version, address, mapsize
_PSIZE_AT = _HDR + _META.size  # mm_dbs[0].md_pad holds the page size
_LAST_AT = _HDR + _META.size + 2 * 48  # mm_last_pg, then mm_txnid


class StoreDamaged(StoreError):
    """data.mdb is shorter than its meta pages say, or has no valid meta page."""


def _meta(buf: bytes) -> tuple[int, int, int] | None:
    """-> (page size, last page, txnid) of one meta page, or None if it is not one."""
    if len(buf) < _LAST_AT + 16:
        return None
    magic, version, _, _ = _META.unpack_from(buf, _HDR)
    if magic != MAGIC:
        return None
    (psize,) = struct.unpack_from("<I", buf, _PSIZE_AT)
    last, txnid = struct.unpack_from("<QQ", buf, _LAST_AT)
    return psize, last, txnid


def required_bytes(data_file: Path) -> int:
    """Bytes data.mdb must hold per its newest valid meta page; StoreDamaged if none is valid."""
    size = data_file.stat().st_size
    with open(data_file, "rb") as f:
        first = f.read(_LAST_AT + 16)
        m0 = _meta(first)
        metas = [m0] if m0 else []
        for psize in {m0[0]} if m0 else {4096, 8192, 16384, 65536}:
            f.seek(psize)
            m1 = _meta(f.read(_LAST_AT + 16))
            if m1 and m1[0] == psize:
                metas.append(m1)
    if not metas:
        raise StoreDamaged(f"{data_file} ({size} bytes) has no valid LMDB meta page: the file is "
                           "truncated or not an LMDB store; move it away or restore it")
    psize, last, _ = max(metas, key=lambda m: m[2])
    return (last + 1) * psize


def check_data_file(path: Path) -> None:
    """Refuse (StoreDamaged, one line) a store whose data.mdb is shorter than its meta pages say."""
    data = path / "data.mdb"
    if not data.exists() or data.stat().st_size == 0:
        return  # a new store
    need, size = required_bytes(data), data.stat().st_size
    if size < need:
        raise StoreDamaged(f"{data} is truncated: {size} bytes, its meta page needs {need}; "
                           "move it away or restore it (opening it would crash on the missing pages)")


def mapped_bytes_ok(fd_path: Path, last_pgno: int, psize: int) -> bool:
    """Whether the file still holds every page the open environment may read."""
    try:
        return os.stat(fd_path).st_size >= (last_pgno + 1) * psize
    except OSError:
        return False
