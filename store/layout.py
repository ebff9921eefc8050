"""How a ContextArtifact maps onto named chunks and a manifest, and back.

Chunks: context-wide `tokens` and `last_logits` (layer None); per layer the K/V as the
context's kv codec stores them (`k`, `v`, plus `k_scale`, `v_scale` for int8: kv_codec.py),
each table as `t_<name>` (the prefix keeps method table names from colliding with k/v) and,
when the indexer kept them, the prefill query sample `q` (read only by Rebuild).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import torch

from ctxcache.artifact import ContextArtifact, LayerArtifact
from ctxcache.store.codec import Encoded, torch_dtype
from ctxcache.kv_codec import SCALE_SUFFIX, CodedKV
from ctxcache.store.keys import check_name
from ctxcache.store.manifest import ChunkInfo, ContextMeta, Manifest

TABLE_PREFIX = "t_"
QUERY_CHUNK = "q"
Slot = tuple[int | None, str]  # (layer, chunk name)


def chunk_tensors(art: ContextArtifact) -> list[tuple[Slot, torch.Tensor]]:
    """Every tensor of the artifact with its slot, in a fixed order."""
    out: list[tuple[Slot, torch.Tensor]] = [((None, "tokens"), art.tokens),
                                            ((None, "last_logits"), art.last_logits)]
    for i, layer in enumerate(art.layers):
        out += layer_chunks(i, layer, art.kv_codec)
    return out


def layer_chunks(i: int, layer: LayerArtifact, kv_codec: str) -> list[tuple[Slot, torch.Tensor]]:
    """Layer i's tensors with their slots, in chunk_tensors' order (a streaming writer stores
    each layer as the build finishes it)."""
    # a layer built coded (the indexer encodes on the build's device) is stored as it is
    out = [((i, name), t) for name, t in layer.coded_as(kv_codec).parts.items()]
    for name in sorted(layer.tables):
        out.append(((i, check_name(TABLE_PREFIX + name)), layer.tables[name]))
    if layer.queries is not None:
        out.append(((i, QUERY_CHUNK), layer.queries))
    return out


def _check_json(what: str, value: dict) -> dict:
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what} must be JSON-serialisable to be stored: {exc}") from None


def build_manifest(context_id: str, art: ContextArtifact, meta: ContextMeta,
                   slots: Sequence[Slot], tensors: Sequence[torch.Tensor],
                   encoded: Sequence[Encoded], now: float) -> Manifest:
    chunks = tuple(
        ChunkInfo(layer=layer, name=name, dtype=str(t.dtype).removeprefix("torch."),
                  shape=tuple(t.shape), codec=e.codec, stored_dtype=e.stored_dtype,
                  raw_bytes=e.raw_bytes, stored_bytes=len(memoryview(e.payload).cast("B")),
                  sha256=e.sha256, xxh3=e.xxh3)
        for (layer, name), t, e in zip(slots, tensors, encoded, strict=True))
    return Manifest(
        context_id=context_id, format_version=art.format_version, model_id=art.model_id,
        model_args=_check_json("model_args", art.model_args), kv_dtype=art.kv_dtype, kv_codec=art.kv_codec,
        method=art.method, method_params=_check_json("method_params", art.method_params),
        n_tokens=art.n_tokens, n_layers=len(art.layers), chunks=chunks, created_at=now,
        ttl_s=meta.ttl_s, pinned=meta.pinned, labels=dict(meta.labels), tenant=meta.tenant,
        prompt_hash=meta.prompt_hash, raw_kv_bytes=art.kv_bytes(),
        raw_table_bytes=art.table_bytes(), stored_bytes=sum(c.stored_bytes for c in chunks),
        last_access=now)


def assemble(m: Manifest, chunks: Sequence[ChunkInfo], tensors: Sequence[torch.Tensor]) -> ContextArtifact:
    """Inverse of chunk_tensors: some of the manifest's chunks (in order; all but the
    optional query chunks must be there) and their tensors. Lossy K/V stay coded (CodedKV):
    they are decoded where the context decodes (LayerArtifact.kv_into), not here."""
    ctx: dict[str, torch.Tensor] = {}
    layers: list[dict[str, torch.Tensor]] = [{} for _ in range(m.n_layers)]
    for info, t in zip(chunks, tensors, strict=True):
        (ctx if info.layer is None else layers[info.layer])[info.name] = t
    dtype = torch_dtype(m.kv_dtype)
    out = []
    for parts in layers:
        tables = {n.removeprefix(TABLE_PREFIX): t for n, t in parts.items()
                  if n.startswith(TABLE_PREFIX)}
        out.append(_layer(parts, m.kv_codec, dtype, tables))
    return ContextArtifact(
        model_id=m.model_id, model_args=m.model_args, method=m.method,
        method_params=m.method_params, tokens=ctx["tokens"], last_logits=ctx["last_logits"],
        layers=out, kv_dtype=m.kv_dtype, kv_codec=m.kv_codec, format_version=m.format_version)


def _layer(parts: dict[str, torch.Tensor], kv_codec: str, dtype: torch.dtype,
           tables: dict[str, torch.Tensor]) -> LayerArtifact:
    queries = parts.get(QUERY_CHUNK)
    if kv_codec == "lossless":  # stored as decoded: nothing to do where it decodes
        return LayerArtifact(k=parts["k"].to(dtype), v=parts["v"].to(dtype), tables=tables, queries=queries)
    kv = {n: t for n, t in parts.items() if n != QUERY_CHUNK and not n.startswith(TABLE_PREFIX)}
    shape = tuple(parts["v"].shape) if kv_codec == "int8" else _int4_shape(kv)
    return LayerArtifact(coded=CodedKV(kv_codec, kv, shape, dtype), tables=tables, queries=queries)


def _int4_shape(kv: dict[str, torch.Tensor]) -> tuple[int, int, int]:
    """[Hkv, N, D] of an int4 layer: v's scales are [Hkv, N, D/G], k's [Hkv, D, N/G]."""
    hkv, n, _ = kv["v" + SCALE_SUFFIX].shape
    return hkv, n, kv["k" + SCALE_SUFFIX].shape[1]
