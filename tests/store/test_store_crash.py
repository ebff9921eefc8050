"""SIGKILL during put/delete at random points: the store reopens cleanly and never lists or
serves a partial artifact; every completed put (not deleted since) survives."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import lmdb

from ctxcache.store import ArtifactStore, StoreConfig
from store_helpers import assert_same, crash_pool

ROUNDS = int(os.environ.get("CTXCACHE_CRASH_ROUNDS", "24"))


def _parse(log: str) -> tuple[set[str], set[str], set[str], int]:
    started, done, deleted, mid_put, last = set(), set(), set(), 0, ""
    for line in log.splitlines():
        kind, *rest = line.split()
        if kind == "start":
            started.add(rest[0])
        elif kind == "done":
            done.add(rest[0])
        elif kind in ("delstart", "deleted"):
            # a delete killed after its commit but before its log line is gone too, so any
            # delete that started may have happened
            deleted.add(rest[0])
        elif kind == "killed":
            mid_put += last.startswith("start ")
        last = line
    return started, done, deleted, mid_put


def _orphans(path: Path, ids: set[str]) -> list[bytes]:
    env = lmdb.open(str(path), readonly=True, lock=False)
    with env.begin() as txn:
        keys = [k for k, _ in txn.cursor()]
    env.close()
    pat = re.compile(rb"ctxcache:v1:(?:chunk|access):([^:]+)")
    return [k for k in keys if (m := pat.match(k)) and m.group(1).decode() not in ids]


def test_sigkill_during_put_never_exposes_partial_artifacts(tmp_path: Path) -> None:
    store_dir, log = tmp_path / "store", tmp_path / "log.txt"
    writer = Path(__file__).with_name("crash_writer.py")
    subprocess.run([sys.executable, str(writer), str(store_dir), str(log), str(ROUNDS), "7"],
                   check=True, timeout=300)
    started, done, deleted, mid_put = _parse(log.read_text())
    assert log.read_text().count("killed") == ROUNDS
    assert mid_put >= ROUNDS // 4, f"only {mid_put} of {ROUNDS} kills landed inside a put"
    pool = crash_pool()
    with ArtifactStore(store_dir, StoreConfig(map_size_bytes=512 << 20,
                                              budget_bytes=512 << 20)) as s:
        ids = set(s.context_ids())
        listed = {m.context_id for m in s.list_manifests(limit=100_000)}
        assert listed == ids <= started
        assert done - deleted <= ids, "a completed put (never deleted) was lost"
        for m in s.list_manifests(limit=100_000):
            assert s.verify(m.context_id).ok
            assert_same(pool[int(m.labels["j"])], s.get(m.context_id))
    assert _orphans(store_dir, ids) == []
