"""Typed store errors; the service maps each to one gRPC status code (see comments)."""

from __future__ import annotations


class StoreError(Exception):
    """Base of every error the store raises on purpose."""


class WriteStopped(StoreError):
    """A chunk not stored because its write (a streaming put) had already failed or been given up."""


class CorruptArtifact(StoreError):
    """A stored chunk or manifest fails its size or checksum check (service: DATA_LOSS)."""

    def __init__(self, context_id: str, chunk: str, reason: str) -> None:
        super().__init__(f"context {context_id}: chunk {chunk}: {reason}")
        self.context_id, self.chunk, self.reason = context_id, chunk, reason


class StoreFull(StoreError):
    """No room even after evicting every unpinned context it could (service: RESOURCE_EXHAUSTED)."""


class StoreClosed(StoreError):
    """The store was closed, or is used in a process other than the one that opened it."""


class FormatMismatch(StoreError):
    """A stored context of a format this code does not read: refused, never misread
    (service: FAILED_PRECONDITION). The message names the version found and those read."""

    def __init__(self, context_id: str, what: str, found: object, readable: tuple) -> None:
        super().__init__(f"context {context_id}: {what}={found!r} is not readable by this server "
                         f"(it reads {what} {', '.join(map(str, readable))}); rebuild it from its text")
        self.context_id, self.found = context_id, found


class StoreUnavailable(StoreError):
    """The shared object store did not answer, or not within its deadline (service: UNAVAILABLE).
    Contexts in local tiers keep serving; a load that needs the object store fails fast.
    The message names the URI (for the server log and admin callers); `public` is what a
    tenant reads: the failing part, no address."""

    public = "object store unavailable"


class StoreDeadline(StoreError):
    """The request's deadline came before the object store answered (service: DEADLINE_EXCEEDED).
    Not an outage (the client allowed less time than a healthy store may need), so it opens no
    circuit breaker. The message names the URI; `public` is what a tenant reads."""

    public = "the object store did not answer before the request's deadline"
