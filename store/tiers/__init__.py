"""Shared artifact tiers: one ObjectTier class per object store backend, chosen by URI scheme.

    tier = open_tier("s3://bucket/prefix?endpoint_override=127.0.0.1:8333&scheme=http")
    tier = open_tier("file:///mnt/shared/ctxcache")

Backends import lazily (pyarrow's S3 initialises only where an s3:// URI is opened).
"""

from __future__ import annotations

import importlib
from urllib.parse import urlsplit

from ctxcache.store.tiers.base import ObjectInfo, ObjectTier, TierConfig, check_key

# scheme -> "module:Class" under ctxcache.store.tiers
BACKENDS = {"s3": "s3:S3Tier", "file": "file:FileTier"}
EXAMPLES = "s3://bucket/prefix?endpoint_override=host:port&scheme=http or file:///absolute/path"


def tier_class(uri: str) -> type[ObjectTier]:
    scheme = urlsplit(uri).scheme if isinstance(uri, str) else ""
    target = BACKENDS.get(scheme)
    if target is None:
        raise ValueError(f"object store URI {uri!r}: scheme {scheme!r} is not supported "
                         f"(supported: {sorted(BACKENDS)}); e.g. {EXAMPLES}")
    module, name = target.split(":")
    return getattr(importlib.import_module(f"ctxcache.store.tiers.{module}"), name)


def open_tier(uri: str, config: TierConfig = TierConfig()) -> ObjectTier:
    """The backend for uri; ValueError (naming the URI and what is wrong) for a bad one.
    Opening sends no request: an unreachable store fails its first operation (StoreUnavailable)."""
    return tier_class(uri)(uri, config)


__all__ = ["BACKENDS", "ObjectInfo", "ObjectTier", "TierConfig", "check_key", "open_tier", "tier_class"]
