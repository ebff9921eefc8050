"""Bytes per context token, stored and resident, per K/V codec: what `admin stats` reports so a
user can size a deployment (store budget from the stored bytes, DRAM / HBM from the resident).

Resident = the K/V decoded to their dtype + the tables as stored + what the method derives at
load on a GPU (SparseMethod.derived_bytes: CSAttention's dense rows, format 2 only; format 1
stored them): the most a context holds while decoding. The CPU reference computes each step's
routed rows instead, so there it holds the K/V and the stored tables only. The prefill query
sample is never resident (decoding does not load it)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from ctxcache.methods import make_method
from ctxcache.client.gen.v1 import admin_pb2 as apb
from ctxcache.store import Manifest
from ctxcache.store.layout import QUERY_CHUNK, TABLE_PREFIX


def resident_bytes(m: Manifest) -> int:
    derived = 0
    if m.format_version >= 2:
        method = make_method(m.method, m.method_params)
        derived = m.n_layers * method.derived_bytes(m.n_tokens, int(m.model_args.get("n_kv_heads", 0)))
    tables = sum(c.raw_bytes for c in m.chunks if c.name.startswith(TABLE_PREFIX))
    return m.raw_kv_bytes + tables + derived


def stored_bytes(m: Manifest) -> int:
    """Stored bytes without the optional query sample (reported apart: it is opt-in)."""
    return sum(c.stored_bytes for c in m.chunks if c.name != QUERY_CHUNK)


def stored_bytes_by_part(m: Manifest) -> dict[str, int]:
    """Stored bytes of one context by part: kv (K, V and their codec's scales), tables, queries,
    other (context-wide chunks: tokens, last logits)."""
    parts = dict.fromkeys(("kv", "tables", "queries", "other"), 0)
    for c in m.chunks:
        parts[_part(c.layer, c.name)] += c.stored_bytes
    return parts


def _part(layer: int | None, name: str) -> str:
    if layer is None:
        return "other"
    if name == QUERY_CHUNK:
        return "queries"
    return "tables" if name.startswith(TABLE_PREFIX) else "kv"  # per layer the rest is the K/V codec's


def codec_footprint(manifests: Iterable[Manifest]) -> list[apb.CodecFootprint]:
    sums: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for m in manifests:
        row = sums[m.kv_codec]
        row[0] += 1
        row[1] += m.n_tokens
        row[2] += stored_bytes(m)
        row[3] += resident_bytes(m)
    return [apb.CodecFootprint(kv_codec=codec, contexts=n, tokens=tok, stored_bytes=st, resident_bytes=res,
                               stored_bytes_per_token=st / max(tok, 1), resident_bytes_per_token=res / max(tok, 1))
            for codec, (n, tok, st, res) in sorted(sums.items())]
