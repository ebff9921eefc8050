"""Child process for test_store_truncation: a SIGBUS here kills only this process, and the
parent sees it as a negative exit code. argv: store folder, n truncations, seed."""

from __future__ import annotations

import json
import random
import shutil
import sys
from pathlib import Path

from ctxcache.store import ArtifactStore, CorruptArtifact, StoreConfig, StoreDamaged

src, n, seed = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
size = (src / "data.mdb").stat().st_size
rng = random.Random(seed)
results = []
for i in range(n):
    cut = int(size * rng.uniform(0.05, 0.999))
    dst = src.parent / f"cut{i}"
    shutil.copytree(src, dst)
    with open(dst / "data.mdb", "r+b") as f:
        f.truncate(cut)
    try:
        store = ArtifactStore(dst, StoreConfig(map_size_bytes=1 << 30, budget_bytes=1 << 29))
    except StoreDamaged as exc:
        results.append({"cut": cut, "outcome": "refused", "line": str(exc)})
        continue
    outcomes = []
    for cid in store.context_ids():
        try:
            outcomes.append("ok" if store.get(cid) is not None else "absent")
        except CorruptArtifact:
            outcomes.append("data_loss")
    store.close()
    results.append({"cut": cut, "outcome": "opened", "reads": outcomes})
print(json.dumps({"size": size, "results": results}))
