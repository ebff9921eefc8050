"""The context artifact: what the indexer produces and the decoder consumes.

`store/` serialises exactly these fields; bump FORMAT_VERSION on any change of meaning.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

# 2: tables hold the method's compact state (SparseMethod.persist; CSAttention: no dense rows),
#    K/V stored by a per-context codec (kv_codec). 1: every table stored, K/V lossless.
FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2)  # format 1 decodes as is: restore finds its rows already there
KV_CODECS = ("lossless", "int8", "int4")  # store/kv_codec.py


@dataclass
class LayerArtifact:
    """One layer of a cached context.

    k, v: [Hkv, N, D] post-RoPE keys and values (`ContextArtifact.kv_dtype`).
    tables: the sparse method's named index arrays as it persists them (SparseMethod.persist),
      e.g. for CSAttention's dense layout only centroids [Hkv, m, C, d_b] fp16: its rows
      dense_score [Hkv, m, C, N] are derived at load (SparseMethod.restore); its list layout
      stores list_idx [Hkv, m, C, L] int32, list_score [Hkv, m, C, L] fp16, list_floor ....
    queries: optional [Hq, S, D] fp16 sample of the post-RoPE prefill queries (see
      `indexer.build.query_positions`), kept so query-built tables can be rebuilt with new
      parameters without re-prefilling; decoding never reads them (the store skips them).
    """

    k: torch.Tensor
    v: torch.Tensor
    tables: dict[str, torch.Tensor] = field(default_factory=dict)
    queries: torch.Tensor | None = None

    def kv_bytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def table_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tables.values())

    def query_bytes(self) -> int:
        q = self.queries
        return 0 if q is None else q.numel() * q.element_size()


@dataclass
class ContextArtifact:
    """A prefilled, indexed context.

    tokens [N] int64: the context's token ids; last_logits [V] fp32: the logits after the
    last context token (so generation may start with no new prompt); method/method_params:
    the sparse method (`ctxcache.methods.make_method`) that built `tables`.
    Layers hold what the method persists; `SparseMethod.restore` derives the rest at load.
    """

    model_id: str
    model_args: dict[str, Any]
    method: str
    method_params: dict[str, Any]
    tokens: torch.Tensor
    last_logits: torch.Tensor
    layers: list[LayerArtifact]
    kv_dtype: str = "float16"
    kv_codec: str = "lossless"  # how the store encodes k/v (KV_CODECS); decoded to kv_dtype
    format_version: int = FORMAT_VERSION

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.numel())

    def kv_bytes(self) -> int:
        return sum(layer.kv_bytes() for layer in self.layers)

    def table_bytes(self) -> int:
        return sum(layer.table_bytes() for layer in self.layers)
