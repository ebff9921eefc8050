"""What the store records about a context: its metadata and its manifest (no torch).

The manifest is committed in the same LMDB transaction as its chunks, so a manifest that can
be read always describes a complete artifact. Its JSON is stored behind its own sha256 so a
damaged manifest is reported as corruption, not parsed into nonsense.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

STORE_FORMAT = 3  # layout of manifest + chunks; bump on any change of meaning
# 2 adds kv_codec; a format-1 manifest reads as kv_codec "lossless" (what it stored).
# 3 adds write_id, the object store's name for one write of the chunks, chosen before any chunk
# is uploaded (object/object_writer.py); a manifest without one (LMDB's own, or an object-store
# write of format <= 2) stays format 2, its write id derived from its hash (object_layout.py)
READABLE_STORE_FORMATS = (1, 2, 3)
NAMED_WRITE_FORMAT = 3
WRITE_ID_CHARS = 32  # 128 random bits, hex
_WRITE_ID = re.compile(f"[0-9a-f]{{{WRITE_ID_CHARS}}}")


class UnsupportedFormat(ValueError):
    """A manifest of a store format this code does not read (never guessed at)."""

    def __init__(self, found: object) -> None:
        super().__init__(f"store_format={found!r}; this code reads {READABLE_STORE_FORMATS}")
        self.found = found


@dataclass(frozen=True)
class ContextMeta:
    """What the caller says about a context at put time."""

    labels: dict[str, str] = field(default_factory=dict)
    ttl_s: float | None = None  # None: no expiry
    pinned: bool = False  # pinned contexts are never evicted (LRU, budget or TTL)
    tenant: str = ""
    prompt_hash: str = ""  # the registry key this context answers; "" if none

    def __post_init__(self) -> None:
        bad = {k: v for k, v in self.labels.items() if not isinstance(k, str) or not isinstance(v, str)}
        if bad:
            raise ValueError(f"labels must map str to str; bad entries: {bad!r}")
        if self.ttl_s is not None and not (self.ttl_s > 0 and math.isfinite(self.ttl_s)):
            raise ValueError(f"ttl_s={self.ttl_s} must be None or a finite number > 0")


@dataclass(frozen=True)
class ChunkInfo:
    """One stored tensor: how it was encoded, its sizes and the sha256 of its stored bytes."""

    layer: int | None  # None: context-wide (tokens, last_logits)
    name: str
    dtype: str  # torch dtype name of the tensor as returned, e.g. "float16"
    shape: tuple[int, ...]
    codec: str  # "raw" | "zstd" | "shuf+zstd"
    stored_dtype: str  # numpy dtype of the encoded elements (narrower than dtype for indices)
    raw_bytes: int  # bytes of the decoded tensor
    stored_bytes: int
    sha256: str  # of the stored bytes; checked by verify()
    xxh3: str  # xxh3-64 of the stored bytes; checked on every load (fast)

    def label(self) -> str:
        return f"{'ctx' if self.layer is None else self.layer}:{self.name}"


@dataclass(frozen=True)
class Manifest:
    context_id: str
    format_version: int  # ContextArtifact.format_version
    model_id: str
    model_args: dict[str, Any]
    kv_dtype: str
    method: str
    method_params: dict[str, Any]
    n_tokens: int
    n_layers: int
    chunks: tuple[ChunkInfo, ...]
    created_at: float
    ttl_s: float | None
    pinned: bool
    labels: dict[str, str]
    tenant: str
    prompt_hash: str
    raw_kv_bytes: int
    raw_table_bytes: int
    stored_bytes: int  # sum of the chunks' stored bytes
    kv_codec: str = "lossless"  # ContextArtifact.kv_codec (absent from store format 1)
    last_access: float = 0.0  # kept under its own key; filled in when read
    store_format: int = NAMED_WRITE_FORMAT - 1  # `named` makes it 3
    write_id: str = ""  # the object store's write (format 3); "" before (derived from the hash)

    def __post_init__(self) -> None:
        if (self.store_format >= NAMED_WRITE_FORMAT) != bool(self.write_id):
            raise ValueError(f"store_format={self.store_format} with write_id={self.write_id!r}: format "
                             f"{NAMED_WRITE_FORMAT} and only it names its write")
        if self.write_id and not _WRITE_ID.fullmatch(self.write_id):
            raise ValueError(f"write_id={self.write_id!r} must be {WRITE_ID_CHARS} lowercase hex digits")

    def named(self, write_id: str) -> "Manifest":
        """This manifest naming the object-store write its chunks went up under (format 3)."""
        return replace(self, write_id=write_id, store_format=NAMED_WRITE_FORMAT)

    @property
    def expires_at(self) -> float | None:
        return None if self.ttl_s is None else self.created_at + self.ttl_s

    def expired(self, now: float) -> bool:
        """Pinned contexts never expire; see ContextMeta.pinned."""
        return not self.pinned and self.expires_at is not None and now >= self.expires_at

    def raw_bytes(self) -> int:
        return sum(c.raw_bytes for c in self.chunks)

    def with_access(self, last_access: float) -> "Manifest":
        return replace(self, last_access=last_access)

    def to_bytes(self) -> bytes:
        body = asdict(self)
        body.pop("last_access")
        if not body["write_id"]:
            body.pop("write_id")  # a format-2 manifest's bytes stay what they were
        body["chunks"] = [list(c.values()) for c in body["chunks"]]  # compact: ~180 per artifact
        text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
        return hashlib.sha256(text).hexdigest().encode() + b"\n" + text

    @classmethod
    def from_bytes(cls, data: bytes) -> "Manifest":
        """Parse and check; ValueError says what is wrong (the store reports it as corruption)."""
        digest, sep, text = bytes(data).partition(b"\n")
        if not sep or hashlib.sha256(text).hexdigest().encode() != digest:
            raise ValueError("manifest checksum mismatch")
        body = json.loads(text)
        if body.get("store_format") not in READABLE_STORE_FORMATS:
            raise UnsupportedFormat(body.get("store_format"))
        body["chunks"] = tuple(_chunk(c) for c in body["chunks"])
        return cls(**body)


_CHUNK_FIELDS = tuple(f.name for f in fields(ChunkInfo))


def _chunk(values: list[Any]) -> ChunkInfo:
    if len(values) != len(_CHUNK_FIELDS):
        raise ValueError(f"chunk entry has {len(values)} fields, expected {len(_CHUNK_FIELDS)}")
    c = dict(zip(_CHUNK_FIELDS, values))
    return ChunkInfo(**{**c, "shape": tuple(c["shape"])})
