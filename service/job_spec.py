"""A PutSpec as the JSON a build job carries from a decoder to an indexer (no torch).

The job carries the tokens (packed beside it on the stream), so the text itself never
travels: the messages keep their roles only, which is all a build stores of them.
"""

from __future__ import annotations

import json

from ctxcache.service.convert import PutSpec


def to_json(spec: PutSpec) -> str:
    return json.dumps({"roles": list(spec.roles), "labels": spec.labels, "ttl_s": spec.ttl_s, "pin": spec.pin,
                       "method": spec.method, "method_params": spec.method_params, "tenant": spec.tenant,
                       "kv_codec": spec.kv_codec, "keep_queries": spec.keep_queries},
                      sort_keys=True, separators=(",", ":"))


def from_json(text: str) -> PutSpec:
    """ValueError (naming the field) for a job this version cannot read."""
    try:
        d = json.loads(text)
        return PutSpec([{"role": r, "content": ""} for r in d["roles"]], dict(d["labels"]), d["ttl_s"],
                       bool(d["pin"]), str(d["method"]), dict(d["method_params"]), True, str(d["tenant"]),
                       str(d["kv_codec"]), bool(d["keep_queries"]))
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"build job spec {text[:80]!r} is unreadable: {type(exc).__name__}: {exc}") from None
