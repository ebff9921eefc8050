"""The HTTP front in the server's process: uvicorn on its own thread and event loop, calling the
same build queue, decode streams and thread pool as the gRPC servicers (no gRPC hop between).

Why in-process: a front of its own would add a gRPC call per request and per streamed token
on top of the HTTP one, and a second copy of tenants, TLS and drain to keep in step; this one
is measured against gRPC by `ctxcache bench http` (bench/README.md).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import TYPE_CHECKING

import uvicorn

from ctxcache.service.http.app import build_app
from ctxcache.service.http.cached import CachedContents
from ctxcache.service.http.generation import Generation
from ctxcache.service.http.models import ServedModels
from ctxcache.service.http.tokens import Tokens

if TYPE_CHECKING:
    from ctxcache.service.server import CtxcacheServer

log = logging.getLogger("ctxcache.service.http")


class HttpFront:
    def __init__(self, server: CtxcacheServer) -> None:
        s, d = server.config.server, server.config.decoder
        lm = server.lm
        models = ServedModels(lm.model_id, (server.config.model.model,), int(time.time()))
        generation = Generation(server.indexer, server.decoder, server.pool, d.max_tokens_limit, models,
                                s.auto_cache_min_tokens)
        tokens = Tokens(server.indexer.prompter, server.pool, models, lm.args.max_seq_len, lm.args.vocab_size)
        app = build_app(generation, CachedContents(server.indexer, server.decoder, server.pool), tokens, server.auth,
                        server.draining.is_set, server.ready.is_set, server.metrics, s.max_message_bytes)
        tls = {} if s.tls_cert is None else {"ssl_certfile": str(s.tls_cert), "ssl_keyfile": str(s.tls_key)}
        self.config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off", ws="none",
                                     timeout_graceful_shutdown=1, **tls)
        self.uvicorn = uvicorn.Server(self.config)
        self.host = s.host
        self._thread: threading.Thread | None = None

    def start(self, port: int) -> int:
        """Bind host:port (0: a free port) and serve; -> the bound port."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, port))
        except OSError as exc:
            sock.close()
            raise OSError(f"cannot bind the HTTP port {self.host}:{port}: {exc}") from exc
        bound = sock.getsockname()[1]
        self._thread = threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [sock]},
                                        name="ctxcache-http", daemon=True)
        self._thread.start()
        end = time.monotonic() + 30
        while not self.uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > end:
                raise RuntimeError(f"the HTTP front on {self.host}:{bound} did not start")
            time.sleep(0.01)
        log.info("HTTP (OpenAI-compatible) on %s:%d", self.host, bound)
        return bound

    def stop(self, timeout: float = 5.0) -> None:
        """Close the port; open responses get uvicorn's graceful second, then end."""
        self.uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
