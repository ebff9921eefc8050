"""The ctxcache gRPC protocol for any client: the generated stubs (`gen/v1`, from
protos/ctxcache/v1/*.proto by `python -m ctxcache.client.codegen`), a small Client (and its
routing across a fleet), and `server_process`: a server started in its own process, as the
benchmarks and end-to-end tests use one.

It lives apart from the service so that whatever talks to a server (the CLI, the benchmarks,
a user's program) imports the protocol, never the server's code."""

from __future__ import annotations

from typing import Any

__all__ = ["Client", "MAX_MESSAGE"]


def __getattr__(name: str) -> Any:
    # lazy: `python -m ctxcache.client.codegen` must run while gen/ is stale or missing
    if name in __all__:
        from ctxcache.client import connection
        return getattr(connection, name)
    raise AttributeError(f"module 'ctxcache.client' has no attribute {name!r}")
