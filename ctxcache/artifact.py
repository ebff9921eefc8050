"""The context artifact: what the indexer produces and the decoder consumes.

`store/` serialises exactly these fields; bump FORMAT_VERSION on any change of meaning.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ctxcache.kv_codec import CodedKV
from ctxcache.landing import Landing

# 2: tables hold the method's compact state (SparseMethod.persist; CSAttention: no dense rows),
#    K/V stored by a per-context codec (kv_codec). 1: every table stored, K/V lossless.
FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2)  # format 1 decodes as is: restore finds its rows already there
KV_CODECS = ("lossless", "int8", "int4")  # ctxcache/kv_codec.py


class LayerArtifact:
    """One layer of a cached context.

    k, v: [Hkv, N, D] post-RoPE keys and values (`ContextArtifact.kv_dtype`). A layer holds them
      either decoded or `coded` (CodedKV: the context's kv codec's codes and scales, as the store
      keeps them): a loaded artifact stays coded in DRAM (half the bytes at int8) and a runner
      decodes it where it decodes (`kv_into`: on the GPU for the fast runner, so the host does
      no float work). Reading `k` / `v` of a coded layer decodes it on the host once.
    tables: the sparse method's named index arrays as it persists them (SparseMethod.persist),
      e.g. for CSAttention's dense layout only centroids [Hkv, m, C, d_b] fp16: its rows
      dense_score [Hkv, m, C, N] are derived at load (SparseMethod.restore); its list layout
      stores list_idx [Hkv, m, C, L] int32, list_score [Hkv, m, C, L] fp16, list_floor ....
    queries: optional [Hq, S, D] fp16 sample of the post-RoPE prefill queries (see
      `indexer.build.query_positions`), kept so query-built tables can be rebuilt with new
      parameters without re-prefilling; decoding never reads them (the store skips them).
    """

    def __init__(self, k: torch.Tensor | None = None, v: torch.Tensor | None = None,
                 tables: dict[str, torch.Tensor] | None = None, queries: torch.Tensor | None = None,
                 coded: CodedKV | None = None) -> None:
        if (k is None or v is None) and coded is None:
            raise ValueError("a layer needs its k and v, decoded or coded")
        self._k, self._v, self.coded = k, v, coded
        self.tables = {} if tables is None else tables
        self.queries = queries

    @property
    def k(self) -> torch.Tensor:
        self._decode()
        return self._k

    @property
    def v(self) -> torch.Tensor:
        self._decode()
        return self._v

    def _decode(self) -> None:
        if self._k is None:
            self._k, self._v = self.coded.decode()

    @property
    def kv_shape(self) -> tuple[int, ...]:
        return tuple(self._k.shape) if self._k is not None else self.coded.shape

    def with_tables(self, tables: dict[str, torch.Tensor], queries: torch.Tensor | None = None) -> "LayerArtifact":
        """This layer's K/V (the same tensors, decoded or coded) with these tables and queries:
        a build hands a layer's K/V to the store before its tables are built."""
        return LayerArtifact(self._k, self._v, tables, queries, self.coded)

    def coded_as(self, codec: str) -> CodedKV:
        """The K/V as `codec` stores them: the layer's own codes when it holds that codec's,
        else encoded here from the decoded k, v (on their device)."""
        if self.coded is not None and self.coded.codec == codec:
            return self.coded
        return CodedKV.encode(self.k, self.v, codec)

    def kv_into(self, k_out: torch.Tensor, v_out: torch.Tensor) -> None:
        """Write k, v into k_out, v_out [Hkv, N, D] (any dtype, on any device): a coded layer is
        decoded on k_out's device, without keeping the decoded tensors here."""
        if self._k is not None:
            k_out.copy_(self._k, non_blocking=True)
            v_out.copy_(self._v, non_blocking=True)
            return
        self.coded.decode_into(k_out, v_out)

    def kv_bytes(self) -> int:
        """Bytes of the decoded k and v (what a decoder holds), coded or not."""
        shape, dtype = self.kv_shape, self._k.dtype if self._k is not None else self.coded.dtype
        return 2 * math.prod(shape) * torch.empty(0, dtype=dtype).element_size()

    def held_bytes(self) -> int:
        """Bytes this layer's K/V occupy in memory as held (coded: the codes and scales)."""
        return (self.kv_bytes() if self._k is not None else 0) + (self.coded.nbytes() if self.coded else 0)

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
    `landing` is no field of the context (the store writes none of it): see below.
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
    # set while the layers still arrive from the object store (ctxcache/landing.py): tensors are
    # read only after landing.wait(layer); not stored, not compared
    landing: Landing | None = field(default=None, compare=False, repr=False)

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.numel())

    def kv_bytes(self) -> int:
        return sum(layer.kv_bytes() for layer in self.layers)

    def table_bytes(self) -> int:
        return sum(layer.table_bytes() for layer in self.layers)

    def held_kv_bytes(self) -> int:
        """K/V bytes as held in memory (coded layers: their codes and scales)."""
        return sum(layer.held_bytes() for layer in self.layers)
