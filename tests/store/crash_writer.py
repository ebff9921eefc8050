"""Writer killed with SIGKILL at random points (run by test_store_crash.py, not by pytest).

    python crash_writer.py STORE_DIR LOG ROUNDS SEED

Each round forks a child that opens the store (after fork, as the rules say) and loops
put (one transaction, or streamed layer by layer) / delete, logging to LOG before and after
each operation; the parent kills it after a random delay and waits for it, then starts the
next round, so every round also reopens a store whose previous writer died mid-transaction
(or mid-stream: the open sweeps the chunks it left).
"""

from __future__ import annotations

import os
import random
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402

from store_helpers import crash_pool  # noqa: E402


def child(path: str, log: str, rnd: int, pool: list) -> None:
    from ctxcache.store import ArtifactStore, ContextMeta, StoreConfig

    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    store = ArtifactStore(path, StoreConfig(map_size_bytes=512 << 20, budget_bytes=512 << 20))
    i = 0
    while True:
        cid, j = f"r{rnd}-{i}", (rnd + i) % len(pool)
        os.write(fd, f"start {cid} {j}\n".encode())
        if i % 2:  # streamed (a build's put): killed between its layer transactions too
            w = store.writer(cid, ContextMeta(labels={"j": str(j)}))
            for k, layer in enumerate(pool[j].layers):
                w.add_layer(k, layer, pool[j].kv_codec)
            w.finish(pool[j])
        else:
            store.put(cid, pool[j], ContextMeta(labels={"j": str(j)}))
        os.write(fd, f"done {cid} {j}\n".encode())
        if i % 4 == 3:  # deletes are killed mid-transaction too
            old = f"r{rnd}-{i - 2}"
            os.write(fd, f"delstart {old}\n".encode())
            store.delete(old)
            os.write(fd, f"deleted {old}\n".encode())
        i += 1


def main() -> None:
    path, log, rounds, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    torch.set_num_threads(1)  # no intra-op thread pool to inherit across fork
    pool = crash_pool()
    rng = random.Random(seed)
    Path(log).touch()
    for rnd in range(rounds):
        pid = os.fork()
        if pid == 0:
            try:
                child(path, log, rnd, pool)
            finally:
                os._exit(1)
        time.sleep(rng.uniform(0.05, 0.4))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        with open(log, "a") as f:
            f.write(f"killed r{rnd}\n")


if __name__ == "__main__":
    main()
