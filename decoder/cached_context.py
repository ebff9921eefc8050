"""What the DRAM cache holds for one context: its artifact and the roles it was rendered with."""

from __future__ import annotations

from dataclasses import dataclass

from ctxcache.artifact import ContextArtifact


@dataclass(frozen=True)
class CachedContext:
    """What the DRAM cache holds: the artifact and the roles its context was rendered with."""

    artifact: ContextArtifact
    roles: tuple[str, ...]
    stored_bytes: int

    def nbytes(self) -> int:
        a = self.artifact
        return a.held_kv_bytes() + a.table_bytes() + a.tokens.numel() * 8 + a.last_logits.numel() * 4
