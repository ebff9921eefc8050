"""LMDB's data file checked against the pages LMDB may read, so a short file is an error, not SIGBUS.

LMDB maps data.mdb and reads pages through the mapping: a page past the end of a truncated
file is a SIGBUS that kills the whole process (and every client's stream with it).

The meta pages' last page in use is only an upper bound: a commit may allocate pages at the
end that it never writes (LMDB frees loose pages without flushing them), so a healthy file can
be shorter than (last page + 1) x page size (seen: 151 pages, last page 151, under readers
racing a writer that replaces and deletes; a false DATA_LOSS in 1 of ~6 runs of that test).
At open, a file shorter than that bound is walked (plain reads, never the mapping) from both
trees' roots to the pages they really reach; it is refused only when one of those lies past
its end. While open, LMDB (without MDB_WRITEMAP)
only ever grows the file, so a file smaller than it was seen before was cut (one fstat).

Layout (lmdb.h / mdb.c, 64-bit): a page starts with a 16-byte header (pgno u64, pad u16,
flags u16, lower u16 and upper u16, or an overflow page's count u32), then u16 node offsets.
The meta page's MDB_meta: magic u32, version u32, address u64, mapsize u64, two MDB_db of
48 bytes (the free tree, the main tree; md_pad, the first u32, holds the page size in the
first; md_root is the u64 at 40), last_pg u64, txnid u64. A node: lo u16, hi u16, flags u16,
key size u16, key, data; a branch node's child is lo | hi << 16 | flags << 32.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ctxcache.store.errors import StoreError

MAGIC = 0xBEEFC0DE
_HDR = 16
_META = struct.Struct("<IIQQ")  # magic, version, address, mapsize
_DBS_AT = _HDR + _META.size  # mm_dbs[0]; its md_pad holds the page size
_DB_SIZE, _ROOT_AT = 48, 40
LAST_AT = _DBS_AT + 2 * _DB_SIZE  # mm_last_pg, then mm_txnid
_NO_ROOT = (1 << 64) - 1
P_BRANCH, P_LEAF, P_OVERFLOW, P_LEAF2 = 0x01, 0x02, 0x04, 0x20
F_BIGDATA, F_SUBDATA = 0x01, 0x02


class StoreDamaged(StoreError):
    """data.mdb lacks pages its trees reach, or has no valid meta page."""


@dataclass(frozen=True)
class Meta:
    page_size: int
    last_page: int
    txnid: int
    roots: tuple[int, int]  # the free tree's, the main tree's


def _meta(buf: bytes) -> Meta | None:
    if len(buf) < LAST_AT + 16:
        return None
    magic, _, _, _ = _META.unpack_from(buf, _HDR)
    if magic != MAGIC:
        return None
    (psize,) = struct.unpack_from("<I", buf, _DBS_AT)
    free_root, main_root = (struct.unpack_from("<Q", buf, _DBS_AT + i * _DB_SIZE + _ROOT_AT)[0] for i in (0, 1))
    last, txnid = struct.unpack_from("<QQ", buf, LAST_AT)
    return Meta(psize, last, txnid, (free_root, main_root))


def newest_meta(f: BinaryIO, size: int, where: Path) -> Meta:
    """The newest valid meta page (what LMDB opens); StoreDamaged if neither is valid."""
    m0 = _meta(os.pread(f.fileno(), LAST_AT + 16, 0))
    metas = [m0] if m0 else []
    for psize in {m0.page_size} if m0 else {4096, 8192, 16384, 65536}:
        m1 = _meta(os.pread(f.fileno(), LAST_AT + 16, psize))
        if m1 and m1.page_size == psize:
            metas.append(m1)
    if not metas:
        raise StoreDamaged(f"{where} ({size} bytes) has no valid LMDB meta page: the file is "
                           "truncated or not an LMDB store; move it away or restore it")
    return max(metas, key=lambda m: m.txnid)


def _children(page: bytes, psize: int) -> list[int]:
    """Pages a branch or leaf page points to (children, overflow heads, sub-tree roots)."""
    flags, lower = struct.unpack_from("<HH", page, 10)
    if flags & P_LEAF2 or not flags & (P_BRANCH | P_LEAF):
        return []  # fixed-size keys only, or not a tree page (LMDB says MDB_CORRUPTED there)
    out = []
    for i in range(max(0, (lower - _HDR) // 2)):
        (at,) = struct.unpack_from("<H", page, _HDR + 2 * i)
        if at + 8 > psize:
            break
        lo, hi, nflags, ksize = struct.unpack_from("<HHHH", page, at)
        if flags & P_BRANCH:
            out.append(lo | hi << 16 | nflags << 32)
        elif nflags & (F_BIGDATA | F_SUBDATA) and at + 8 + ksize + _DB_SIZE * bool(nflags & F_SUBDATA) <= psize:
            data_at = at + 8 + ksize
            out.append(struct.unpack_from("<Q", page, data_at + (_ROOT_AT if nflags & F_SUBDATA else 0))[0])
    return out


def tree_pages(f: BinaryIO, meta: Meta, roots: Iterable[int]) -> Iterator[tuple[int, int, int]]:
    """(page number, flags, pages it spans) of each page the trees from `roots` reach; flags
    -1 for a page cut off the file's end (unread: it has no children to follow)."""
    psize, fd = meta.page_size, f.fileno()
    seen: set[int] = set()
    todo = [r for r in roots if r != _NO_ROOT]
    while todo:
        pgno = todo.pop()
        if pgno in seen or pgno > meta.last_page:
            continue  # a cycle or a garbage number: damage LMDB reports itself, not a SIGBUS
        seen.add(pgno)
        head = os.pread(fd, _HDR, pgno * psize)
        flags = struct.unpack_from("<H", head, 10)[0] if len(head) == _HDR else 0
        if flags & P_OVERFLOW:  # a value's pages: where they end is all the file must hold
            yield pgno, flags, max(1, struct.unpack_from("<I", head, 12)[0])
            continue
        page = os.pread(fd, psize, pgno * psize)
        if len(page) < psize:  # cut at or inside this page
            yield pgno, -1, 1
            continue
        yield pgno, flags, 1
        todo.extend(_children(page, psize))


def reached_bytes(f: BinaryIO, meta: Meta) -> int:
    """The end of the last page the free and main trees reach (a page past the file's end
    counts): what the file must hold for LMDB never to touch a missing page."""
    ends = ((pgno + pages) * meta.page_size for pgno, _, pages in tree_pages(f, meta, meta.roots))
    return max(2 * meta.page_size, max(ends, default=0))  # the two meta pages at least


def check_data_file(path: Path) -> int:
    """Refuse (StoreDamaged, one line) a data.mdb lacking pages its trees reach; -> its size."""
    data = path / "data.mdb"
    if not data.exists() or data.stat().st_size == 0:
        return 0  # a new store
    with open(data, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        meta = newest_meta(f, size, data)
        if size >= (meta.last_page + 1) * meta.page_size:
            return size
        need = reached_bytes(f, meta)
    if size < need:
        raise StoreDamaged(f"{data} is truncated: {size} bytes, its pages in use need {need}; "
                           "move it away or restore it (opening it would crash on the missing pages)")
    return size


def still_whole(data_file: Path, size_seen: int) -> int | None:
    """The file's size now, or None if it shrank below `size_seen` (LMDB never shrinks it)."""
    try:
        size = os.stat(data_file).st_size
    except OSError:
        return None
    return size if size >= size_seen else None
