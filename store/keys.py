"""Typed, versioned keys shared by LMDB and Redis: `ctxcache:v1:<kind>:<fields...>`.

Every key round-trips through `to_string` / `from_string`; malformed input raises ValueError
naming the bad part, so a stray key in the database is reported, never half-parsed.
This module imports no torch (the registry uses it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PREFIX = "ctxcache"
VERSION = "v1"
_ID = re.compile(r"[A-Za-z0-9_.\-]{1,128}")  # no ':' so fields never split ambiguously
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
GLOBAL_LAYER = "ctx"  # layer field of chunks that belong to the whole context (tokens, logits)


def check_id(value: str, what: str = "context_id") -> str:
    if not isinstance(value, str) or not _ID.fullmatch(value):
        raise ValueError(f"{what}={value!r} must be 1-128 characters of [A-Za-z0-9_.-]")
    return value


def check_name(value: str) -> str:
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise ValueError(f"chunk name={value!r} must match {_NAME.pattern}")
    return value


def _split(text: str, kind: str, n_fields: int) -> list[str]:
    parts = text.split(":")
    head = [PREFIX, VERSION, kind]
    if parts[:3] != head or len(parts) != 3 + n_fields:
        raise ValueError(f"key {text!r} is not of the form {':'.join(head)}:<{n_fields} fields>")
    return parts[3:]


def prefix(kind: str) -> str:
    """Key prefix of one kind, e.g. for cursor scans: 'ctxcache:v1:manifest:'."""
    return f"{PREFIX}:{VERSION}:{kind}:"


@dataclass(frozen=True)
class ManifestKey:
    context_id: str
    kind = "manifest"

    def __post_init__(self) -> None:
        check_id(self.context_id)

    def to_string(self) -> str:
        return prefix(self.kind) + self.context_id

    @classmethod
    def from_string(cls, text: str) -> "ManifestKey":
        (cid,) = _split(text, cls.kind, 1)
        return cls(cid)


@dataclass(frozen=True)
class AccessKey:
    """Last-access time of a context, kept apart so a read rewrites 8 bytes, not the manifest."""

    context_id: str
    kind = "access"

    def __post_init__(self) -> None:
        check_id(self.context_id)

    def to_string(self) -> str:
        return prefix(self.kind) + self.context_id

    @classmethod
    def from_string(cls, text: str) -> "AccessKey":
        (cid,) = _split(text, cls.kind, 1)
        return cls(cid)


@dataclass(frozen=True)
class ChunkKey:
    """One tensor of a context: layer None for context-wide chunks (written 'ctx')."""

    context_id: str
    layer: int | None
    name: str
    kind = "chunk"

    def __post_init__(self) -> None:
        check_id(self.context_id)
        check_name(self.name)
        if self.layer is not None and (not isinstance(self.layer, int) or self.layer < 0):
            raise ValueError(f"layer={self.layer!r} must be None or an int >= 0")

    def to_string(self) -> str:
        layer = GLOBAL_LAYER if self.layer is None else str(self.layer)
        return f"{prefix(self.kind)}{self.context_id}:{layer}:{self.name}"

    @classmethod
    def from_string(cls, text: str) -> "ChunkKey":
        cid, layer, name = _split(text, cls.kind, 3)
        if layer == GLOBAL_LAYER:
            return cls(cid, None, name)
        if not layer.isdigit() or (len(layer) > 1 and layer[0] == "0"):
            raise ValueError(f"key {text!r}: layer field {layer!r} must be '{GLOBAL_LAYER}' "
                             "or a non-negative integer without leading zeros")
        return cls(cid, int(layer), name)


@dataclass(frozen=True)
class PromptKey:
    """Registry entry of one prompt hash (Redis hash or embedded dict key)."""

    prompt_hash: str
    kind = "prompt"

    def __post_init__(self) -> None:
        check_id(self.prompt_hash, "prompt_hash")

    def to_string(self) -> str:
        return prefix(self.kind) + self.prompt_hash

    @classmethod
    def from_string(cls, text: str) -> "PromptKey":
        (h,) = _split(text, cls.kind, 1)
        return cls(h)


@dataclass(frozen=True)
class BuildLockKey:
    """The build claim of one prompt hash (Redis SET NX with a lease)."""

    prompt_hash: str
    kind = "build"

    def __post_init__(self) -> None:
        check_id(self.prompt_hash, "prompt_hash")

    def to_string(self) -> str:
        return prefix(self.kind) + self.prompt_hash

    @classmethod
    def from_string(cls, text: str) -> "BuildLockKey":
        (h,) = _split(text, cls.kind, 1)
        return cls(h)
