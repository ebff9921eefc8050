"""Typed store errors; the service maps each to one gRPC status code (see comments)."""

from __future__ import annotations


class StoreError(Exception):
    """Base of every error the store raises on purpose."""


class CorruptArtifact(StoreError):
    """A stored chunk or manifest fails its size or checksum check (service: DATA_LOSS)."""

    def __init__(self, context_id: str, chunk: str, reason: str) -> None:
        super().__init__(f"context {context_id}: chunk {chunk}: {reason}")
        self.context_id, self.chunk, self.reason = context_id, chunk, reason


class StoreFull(StoreError):
    """No room even after evicting every unpinned context it could (service: RESOURCE_EXHAUSTED)."""


class StoreClosed(StoreError):
    """The store was closed, or is used in a process other than the one that opened it."""
