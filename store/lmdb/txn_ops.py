"""Operations inside one LMDB transaction (the caller owns the transaction)."""

from __future__ import annotations

import struct
from dataclasses import dataclass

import zstandard

from ctxcache.store import codec
from ctxcache.store.config import BadChunk, VerifyReport
from ctxcache.store.keys import AccessKey, ChunkKey, ManifestKey, prefix
from ctxcache.store.manifest import ChunkInfo, Manifest, UnsupportedFormat


@dataclass(frozen=True)
class ManifestRead:
    context_id: str
    manifest: Manifest | None  # None: absent, or unreadable (then error says why)
    error: str | None = None
    unsupported: object = None  # the store_format found, when this code does not read it (not damage)


def read_manifest(txn, context_id: str) -> ManifestRead:  # noqa: ANN001 (lmdb.Transaction)
    raw = txn.get(ManifestKey(context_id).to_string().encode())
    if raw is None:
        return ManifestRead(context_id, None)
    return _parse(txn, context_id, raw)


def _parse(txn, context_id: str, raw) -> ManifestRead:  # noqa: ANN001
    try:
        m = Manifest.from_bytes(bytes(raw))
    except UnsupportedFormat as exc:
        return ManifestRead(context_id, None, str(exc), unsupported=exc.found)
    except (ValueError, TypeError, KeyError) as exc:
        return ManifestRead(context_id, None, f"unreadable manifest: {exc}")
    if m.context_id != context_id:
        return ManifestRead(context_id, None, f"manifest names context {m.context_id!r}")
    access = txn.get(AccessKey(context_id).to_string().encode())
    if access is not None and len(access) == 8:
        m = m.with_access(struct.unpack("<d", bytes(access))[0])
    return ManifestRead(context_id, m)


def scan_manifests(txn, after: str | None = None) -> list[ManifestRead]:  # noqa: ANN001
    """Every manifest in id order (after: strictly after this id)."""
    head = prefix(ManifestKey.kind).encode()
    start = head + after.encode() + b"\0" if after else head
    out = []
    cur = txn.cursor()
    if not cur.set_range(start):
        return out
    for key, raw in cur:
        key = bytes(key)
        if not key.startswith(head):
            break
        cid = ManifestKey.from_string(key.decode()).context_id
        out.append(_parse(txn, cid, raw))
    return out


def delete_context(txn, context_id: str) -> bool:  # noqa: ANN001
    """Delete manifest, access time and every chunk key of the context (by key prefix, so a
    damaged manifest cannot leave chunks behind). True if anything was there."""
    found = txn.delete(ManifestKey(context_id).to_string().encode())
    txn.delete(AccessKey(context_id).to_string().encode())
    head = (prefix(ChunkKey.kind) + context_id + ":").encode()
    cur = txn.cursor()
    if cur.set_range(head):
        while bytes(cur.key()).startswith(head):
            found = True
            if not cur.delete():  # delete() moves to the next record; False at the end
                break
    return found


def orphan_ids(txn) -> list[str]:  # noqa: ANN001
    """Ids with chunk keys and no manifest (a put that never committed), one seek per id."""
    head, out = prefix(ChunkKey.kind).encode(), []
    cur = txn.cursor()
    found = cur.set_range(head)
    while found and bytes(cur.key()).startswith(head):
        cid = bytes(cur.key())[len(head):].split(b":", 1)[0]
        try:
            if txn.get(ManifestKey(cid.decode()).to_string().encode()) is None:
                out.append(cid.decode())
        except ValueError:  # not a context id: a stray key, left alone
            pass
        found = cur.set_range(head + cid + b";")  # ';' follows ':': past this id's chunks
    return out


def check_chunk(info: ChunkInfo, buf) -> str | None:  # noqa: ANN001
    """Why the stored bytes of one chunk are bad, or None if they match the manifest."""
    if buf is None:
        return "chunk is missing"
    if len(buf) != info.stored_bytes:
        return f"stored size {len(buf)} != manifest {info.stored_bytes}"
    if codec.checksum(buf) != info.sha256:
        return "sha256 mismatch"
    if codec.fast_checksum(buf) != info.xxh3:
        return "xxh3 mismatch"
    if "zstd" in info.codec:
        try:
            declared = zstandard.frame_content_size(buf)
        except zstandard.ZstdError as exc:
            return f"bad zstd frame: {exc}"
        n = 1
        for d in info.shape:
            n *= d
        if declared != n * codec.itemsize(info.stored_dtype):
            return f"zstd frame declares {declared} bytes"
    return None


def verify_chunks(txn, context_id: str) -> VerifyReport:  # noqa: ANN001
    read = read_manifest(txn, context_id)
    if read.error:
        return VerifyReport(context_id, True, 0, (BadChunk("manifest", read.error),))
    if read.manifest is None:
        return VerifyReport(context_id, False, 0)
    bad = []
    for info in read.manifest.chunks:
        why = check_chunk(info, txn.get(ChunkKey(context_id, info.layer, info.name).to_string()
                                        .encode()))
        if why:
            bad.append(BadChunk(info.label(), why))
    return VerifyReport(context_id, True, len(read.manifest.chunks), tuple(bad))
