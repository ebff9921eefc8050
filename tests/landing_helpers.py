"""Holding back one layer's chunks of a tiered store's object-store reads (landing tests)."""

from __future__ import annotations

import threading

from ctxcache.store.tiered_store import TieredStore


def hold_layer(store: TieredStore, layer: int, timeout_s: float = 20.0) -> threading.Event:
    """The store's reads of `layer`'s chunks wait until the returned event is set."""
    inner = store.shared.tier.inner
    open_object, gate = inner.open_object, threading.Event()

    def slow(key: str) -> object:  # a chunk's ranges are read once it is open (store/tiers/ranged.py)
        if key.rsplit("/", 1)[-1].startswith(f"{layer}."):
            assert gate.wait(timeout_s), "the held layer was never released"
        return open_object(key)

    inner.open_object = slow
    return gate
