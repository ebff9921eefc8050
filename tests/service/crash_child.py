"""The server process that test_crash.py kills with SIGKILL (started from a forkserver that has
torch and gRPC imported, so each start costs a fork and a tiny model, not a Python start)."""

from __future__ import annotations

import threading
from pathlib import Path


def serve(data: str, redis_url: str | None, conn) -> None:
    from service_helpers import tiny_config
    from ctxcache.service.server import create_server

    server, port = create_server(tiny_config(Path(data), redis_url))
    conn.send(port)
    threading.Event().wait()
