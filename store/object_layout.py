"""Where a context artifact's objects live on the shared tier (no torch, no I/O).

    v1/chunks/<context_id>/<write_id>/<layer>.<name>   one tensor's stored bytes (layer: ctx | 0..)
    v1/manifests/<context_id>                          the checksummed manifest, written LAST
    v1/access/<context_id>                             the time of its last recorded use (LRU hint)

The context id is the content address: sha256 over model, tokenizer, template, kv dtype and
codec, format, method and params, tenant and tokens (ids.py), so one key covers all of them.
`write_id` names one write of the artifact (a hash of its chunks' sha256 and creation time,
recomputed from the manifest by readers): chunk objects are never overwritten, so concurrent
writers of one id cannot mix chunks, and chunks no manifest names are orphans for GC.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from ctxcache.store.keys import GLOBAL_LAYER, check_id, check_name
from ctxcache.store.manifest import ChunkInfo, Manifest

VERSION = "v1"
MANIFESTS = f"{VERSION}/manifests"
CHUNKS = f"{VERSION}/chunks"
ACCESS = f"{VERSION}/access"


def write_id(m: Manifest) -> str:
    h = hashlib.sha256(repr(float(m.created_at)).encode())
    for c in m.chunks:
        h.update(f"\0{c.label()}\0{c.sha256}".encode())
    return h.hexdigest()[:20]


def manifest_key(context_id: str) -> str:
    return f"{MANIFESTS}/{check_id(context_id)}"


def access_key(context_id: str) -> str:
    return f"{ACCESS}/{check_id(context_id)}"


def chunk_prefix(context_id: str) -> str:
    return f"{CHUNKS}/{check_id(context_id)}"


def chunk_key(context_id: str, wid: str, info: ChunkInfo) -> str:
    layer = GLOBAL_LAYER if info.layer is None else str(info.layer)
    return f"{chunk_prefix(context_id)}/{wid}/{layer}.{check_name(info.name)}"


def chunk_keys(m: Manifest) -> list[str]:
    wid = write_id(m)
    return [chunk_key(m.context_id, wid, c) for c in m.chunks]


@dataclass(frozen=True)
class ParsedKey:
    kind: str  # "manifest" | "chunk" | "access"
    context_id: str


def parse_key(key: str) -> ParsedKey | None:
    """The kind and context of one of our keys, or None for anything else under the root."""
    parts = key.split("/")
    if len(parts) < 3 or parts[0] != VERSION:
        return None
    kind = {"manifests": "manifest", "chunks": "chunk", "access": "access"}.get(parts[1])
    want = 5 if kind == "chunk" else 3
    if kind is None or len(parts) != want:
        return None
    try:
        return ParsedKey(kind, check_id(parts[2]))
    except ValueError:
        return None
