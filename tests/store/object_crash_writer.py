"""A writer SIGKILLed between its chunks and its manifest (run by test_object_store.py, not pytest).

    python object_crash_writer.py URI CONTEXT_ID

Puts a small artifact to the object store at URI and kills itself (SIGKILL, no cleanup of any
kind) the moment the manifest's upload begins: every chunk is stored, the manifest is not.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from store_helpers import make_artifact  # noqa: E402

from ctxcache.store import ObjectArtifactStore  # noqa: E402
from ctxcache.store.object import object_layout as lay  # noqa: E402


def main(uri: str, context_id: str) -> None:
    store = ObjectArtifactStore(uri)
    put = store.tier.put

    def put_or_die(key: str, data: bytes) -> None:
        if key.startswith(lay.MANIFESTS):
            os.kill(os.getpid(), signal.SIGKILL)
        put(key, data)

    store.tier.put = put_or_die  # type: ignore[method-assign]
    store.put(context_id, make_artifact(77))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
