"""Issue 22 #2: a truncated data.mdb never kills the process (SIGBUS); it is refused at open
with one clear line, or a read of a damaged context is DATA_LOSS (CorruptArtifact)."""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest

from ctxcache.store import ArtifactStore, CorruptArtifact, StoreConfig, StoreDamaged
from ctxcache.store.lmdb.lmdb_file import LAST_AT
from ctxcache.store.lmdb.lmdb_file import (P_BRANCH, P_LEAF, P_OVERFLOW, newest_meta, reached_bytes,
                                      tree_pages)

from store_helpers import make_artifact

HERE = Path(__file__).parent


def _fill(path: Path, n: int = 6) -> list[str]:
    ids = [f"{i:064x}" for i in range(1, n + 1)]
    with ArtifactStore(path, StoreConfig(map_size_bytes=1 << 30, budget_bytes=1 << 29)) as store:
        for i, cid in enumerate(ids):
            store.put(cid, make_artifact(seed=i, n=512, layers=4, d=64))
    return ids


def test_20_random_truncations_never_crash(tmp_path):
    _fill(tmp_path / "store")
    run = subprocess.run([sys.executable, str(HERE / "truncate_child.py"), str(tmp_path / "store"), "20", "22"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"child died with {run.returncode}: {run.stderr[-2000:]}"
    results = json.loads(run.stdout)["results"]
    assert len(results) == 20
    for r in results:
        if r["outcome"] == "refused":
            assert "\n" not in r["line"] and "truncated" in r["line"], r
        else:  # opened: every context either reads or is DATA_LOSS
            assert set(r["reads"]) <= {"ok", "data_loss"}, r
    print({o: sum(r["outcome"] == o for r in results) for o in ("refused", "opened")})


def test_a_file_cut_while_open_is_data_loss_not_sigbus(tmp_path):
    ids = _fill(tmp_path / "store", 3)
    store = ArtifactStore(tmp_path / "store", StoreConfig(map_size_bytes=1 << 30, budget_bytes=1 << 29))
    try:
        data = tmp_path / "store" / "data.mdb"
        with open(data, "r+b") as f:
            f.truncate(data.stat().st_size // 2)
        with pytest.raises(CorruptArtifact, match="truncated"):
            store.get(ids[-1])
        with pytest.raises(StoreDamaged):
            store.list_manifests()
    finally:
        store.close()


def test_a_file_without_meta_pages_is_refused(tmp_path):
    _fill(tmp_path / "store", 1)
    with open(tmp_path / "store" / "data.mdb", "r+b") as f:
        f.truncate(100)
    with pytest.raises(StoreDamaged, match="no valid LMDB meta page"):
        ArtifactStore(tmp_path / "store", StoreConfig(map_size_bytes=1 << 30, budget_bytes=1 << 29))


def _reached(data: Path) -> tuple[int, int, int]:
    """(bytes the trees reach, the meta's bound, the page size) of a closed store's file."""
    with open(data, "rb") as f:
        meta = newest_meta(f, data.stat().st_size, data)
        return reached_bytes(f, meta), (meta.last_page + 1) * meta.page_size, meta.page_size


def test_the_walk_finds_the_last_page_in_use(tmp_path):
    """Cut one page below what the trees reach: refused; cut to exactly that (the free tail
    gone): opens, and every context reads whole."""
    ids = _fill(tmp_path / "store", 6)
    with ArtifactStore(tmp_path / "store", StoreConfig(map_size_bytes=1 << 30, budget_bytes=1 << 29)) as s:
        s.delete(ids[-1])  # frees the tail: the trees now reach less than the file holds
        s.delete(ids[-2])
    data = tmp_path / "store" / "data.mdb"
    reached, bound, psize = _reached(data)
    assert 2 * psize < reached <= data.stat().st_size <= bound
    for cut, refused in ((reached - psize, True), (reached, False)):
        dst = tmp_path / f"cut{cut}"
        shutil.copytree(tmp_path / "store", dst)
        os.truncate(dst / "data.mdb", cut)
        if refused:
            with pytest.raises(StoreDamaged, match="truncated"):
                ArtifactStore(dst, StoreConfig(map_size_bytes=1 << 30, budget_bytes=1 << 29))
            continue
        with ArtifactStore(dst, StoreConfig(map_size_bytes=1 << 30, budget_bytes=1 << 29)) as s:
            assert sorted(s.context_ids()) == sorted(ids[:-2])
            assert all(s.get(cid) is not None for cid in ids[:-2])


def test_a_file_short_of_its_last_page_but_whole_opens(tmp_path):
    """LMDB may end a commit with pages allocated at the end and never written (loose pages):
    the meta page's last page then lies past the file's end on a healthy store."""
    ids = _fill(tmp_path / "store", 2)
    data = tmp_path / "store" / "data.mdb"
    reached, bound, psize = _reached(data)
    with open(data, "r+b") as f:  # as such a commit leaves it: the last page 3 pages further on
        for at in (0, psize):
            f.seek(at + LAST_AT)
            (last,) = struct.unpack("<Q", f.read(8))
            f.seek(at + LAST_AT)
            f.write(struct.pack("<Q", last + 3))
    assert data.stat().st_size < _reached(data)[1]
    with ArtifactStore(tmp_path / "store", StoreConfig(map_size_bytes=1 << 30, budget_bytes=1 << 29)) as s:
        assert all(s.get(cid) is not None for cid in ids)


def test_the_walk_reaches_every_page_lmdb_counts(tmp_path):
    """The hand-written page walk against LMDB's own counts: branch, leaf and overflow pages."""
    env = lmdb.open(str(tmp_path), map_size=1 << 30)
    rng = random.Random(5)
    with env.begin(write=True) as txn:
        for i in range(20_000):
            txn.put(b"k%06d" % i, rng.randbytes(9000 if i % 3 == 0 else rng.randrange(1, 200)))
    stat = env.stat()
    env.close()
    data = tmp_path / "data.mdb"
    with open(data, "rb") as f:
        meta = newest_meta(f, data.stat().st_size, data)
        kinds = {P_BRANCH: 0, P_LEAF: 0, P_OVERFLOW: 0}
        for _, flags, pages in tree_pages(f, meta, meta.roots[1:]):
            kinds[flags & 0x07] += pages
    assert (kinds[P_BRANCH], kinds[P_LEAF], kinds[P_OVERFLOW]) == (
        stat["branch_pages"], stat["leaf_pages"], stat["overflow_pages"])
    assert stat["branch_pages"] > 0 and stat["overflow_pages"] > 0
