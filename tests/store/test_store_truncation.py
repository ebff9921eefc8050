"""Issue 22 #2: a truncated data.mdb never kills the process (SIGBUS); it is refused at open
with one clear line, or a read of a damaged context is DATA_LOSS (CorruptArtifact)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ctxcache.store import ArtifactStore, CorruptArtifact, StoreConfig, StoreDamaged

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
