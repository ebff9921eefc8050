"""Where a context artifact's objects live on the shared tier (no torch, no I/O).

    v1/chunks/<context_id>.<write_id>/<layer>.<name>   one tensor's stored bytes (layer: ctx | 0..)
    v1/manifests/<context_id>                          the checksummed manifest, written LAST
    v1/access/<context_id>                             the time of its last recorded use (LRU hint)

The context id is the content address: sha256 over model, tokenizer, template, kv dtype and
codec, format, method and params, tenant and tokens (ids.py), so one key covers all of them.
`write_id` names one write of the artifact: 128 random bits chosen before its first chunk goes
up, so each chunk is uploaded as soon as it is encoded (object_writer.py), and recorded in the
manifest (store format 3). A manifest of format <= 2 names none: its write id is a hash of its
chunks' sha256 and creation time (`legacy_write_id`, 20 hex digits), recomputed by readers, so
those artifacts read, verify, replace and collect as before (no migration). Chunk objects are
never overwritten, so concurrent writers of one id cannot mix chunks. A write's chunks share
one folder, deleted in one batch (no per-context folder is left behind), and a folder no
manifest names is an orphan for GC (a write that failed or was abandoned before its manifest).
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

from ctxcache.store.keys import GLOBAL_LAYER, check_id, check_name
from ctxcache.store.manifest import WRITE_ID_CHARS, ChunkInfo, Manifest

VERSION = "v1"
MANIFESTS = f"{VERSION}/manifests"
CHUNKS = f"{VERSION}/chunks"
ACCESS = f"{VERSION}/access"


_LEGACY_WID_CHARS = 20


def new_write_id() -> str:
    """A fresh write's id, before any of its chunks exists."""
    return secrets.token_hex(WRITE_ID_CHARS // 2)


def legacy_write_id(m: Manifest) -> str:
    """The write id of a manifest that names none (store format <= 2), from its hash."""
    h = hashlib.sha256(repr(float(m.created_at)).encode())
    for c in m.chunks:
        h.update(f"\0{c.label()}\0{c.sha256}".encode())
    return h.hexdigest()[:_LEGACY_WID_CHARS]


def write_id(m: Manifest) -> str:
    return m.write_id or legacy_write_id(m)


def manifest_key(context_id: str) -> str:
    return f"{MANIFESTS}/{check_id(context_id)}"


def access_key(context_id: str) -> str:
    return f"{ACCESS}/{check_id(context_id)}"


def write_folder(context_id: str, wid: str) -> str:
    """The folder of one write's chunks."""
    return f"{CHUNKS}/{check_id(context_id)}.{wid}"


def folder_of(m: Manifest) -> str:
    return write_folder(m.context_id, write_id(m))


def slot_key(context_id: str, wid: str, layer: int | None, name: str) -> str:
    """The object of one chunk (layer None: context-wide) of write `wid`."""
    where = GLOBAL_LAYER if layer is None else str(layer)
    return f"{write_folder(context_id, wid)}/{where}.{check_name(name)}"


def chunk_key(context_id: str, wid: str, info: ChunkInfo) -> str:
    return slot_key(context_id, wid, info.layer, info.name)


def chunk_keys(m: Manifest) -> list[str]:
    wid = write_id(m)
    return [chunk_key(m.context_id, wid, c) for c in m.chunks]


def split_folder(name: str) -> tuple[str, str] | None:
    """'<context_id>.<write_id>' -> (context_id, write_id), or None if it is not one."""
    cid, dot, wid = name.rpartition(".")
    if not dot or len(wid) not in (WRITE_ID_CHARS, _LEGACY_WID_CHARS) or not all(c in "0123456789abcdef" for c in wid):
        return None
    try:
        return check_id(cid), wid
    except ValueError:
        return None


def context_of_folder(key: str) -> str | None:
    """The context id of a write folder's key ('v1/chunks/<context_id>.<write_id>'), else None."""
    split = split_folder(key.rsplit("/", 1)[-1])
    return None if split is None else split[0]


@dataclass(frozen=True)
class ParsedKey:
    kind: str  # "manifest" | "chunk" | "access"
    context_id: str
    folder: str = ""  # chunks: the write folder's name, '<context_id>.<write_id>'


def parse_key(key: str) -> ParsedKey | None:
    """The kind and context of one of our keys, or None for anything else under the root."""
    parts = key.split("/")
    if len(parts) < 3 or parts[0] != VERSION:
        return None
    if parts[1] == "chunks" and len(parts) == 4 and (split := split_folder(parts[2])) is not None:
        return ParsedKey("chunk", split[0], parts[2])
    kind = {"manifests": "manifest", "access": "access"}.get(parts[1])
    if kind is None or len(parts) != 3:
        return None
    try:
        return ParsedKey(kind, check_id(parts[2]))
    except ValueError:
        return None
