"""A build job's spec (PutSpec), and its JSON as a job carries it from a decoder to an indexer
(plain data: no torch here).

The job carries the tokens (packed beside it on the stream), so the text itself never
travels: the messages keep their roles only, which is all a build stores of them. A Rebuild's
job names its source context instead of carrying its K/V: the indexer reads them from the
object store, the copy of record every worker shares.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ctxcache.prompting import Messages

if TYPE_CHECKING:
    from ctxcache.artifact import ContextArtifact

ROLES_LABEL = "ctxcache/roles"  # the stored label that keeps a context's message roles (PutSpec.roles)


@dataclass(frozen=True)
class PutSpec:
    """A PutContext as the indexer builds it (service/convert.py reads it from the request)."""

    messages: Messages
    labels: dict[str, str] = field(default_factory=dict)
    ttl_s: float | None = None
    pin: bool = False
    method: str = ""
    method_params: dict[str, Any] = field(default_factory=dict)
    wait: bool = True
    tenant: str = ""
    kv_codec: str = "int8"
    keep_queries: bool = False

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(m["role"] for m in self.messages)


@dataclass(frozen=True)
class Reindex:
    """Rebuild's source: a stored context whose K/V are re-indexed instead of prefilled."""

    context_id: str
    with_queries: bool  # the new method builds from the stored prefill query sample
    artifact: "ContextArtifact | None" = None  # None on a decoder: the indexer loads it by id


def to_json(spec: PutSpec, source: Reindex | None = None) -> str:
    d = {"roles": list(spec.roles), "labels": spec.labels, "ttl_s": spec.ttl_s, "pin": spec.pin,
         "method": spec.method, "method_params": spec.method_params, "tenant": spec.tenant,
         "kv_codec": spec.kv_codec, "keep_queries": spec.keep_queries}
    if source is not None:
        d["source"] = {"context_id": source.context_id, "with_queries": source.with_queries}
    return json.dumps(d, sort_keys=True, separators=(",", ":"))


def source_of(text: str) -> Reindex | None:
    """The Rebuild source a job names (without its artifact), None for a plain build."""
    try:
        src = json.loads(text).get("source")
        return None if src is None else Reindex(str(src["context_id"]), bool(src["with_queries"]))
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"build job source in {text[:80]!r} is unreadable: {type(exc).__name__}: {exc}") from None


def from_json(text: str) -> PutSpec:
    """ValueError (naming the field) for a job this version cannot read."""
    try:
        d = json.loads(text)
        return PutSpec([{"role": r, "content": ""} for r in d["roles"]], dict(d["labels"]), d["ttl_s"],
                       bool(d["pin"]), str(d["method"]), dict(d["method_params"]), True, str(d["tenant"]),
                       str(d["kv_codec"]), bool(d["keep_queries"]))
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"build job spec {text[:80]!r} is unreadable: {type(exc).__name__}: {exc}") from None
