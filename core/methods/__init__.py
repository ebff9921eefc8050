"""Sparse-attention methods behind one interface, and the registry that names them."""

from __future__ import annotations

from typing import Any

from ctxcache.methods.base import Capabilities, LayerState, MethodParams, SparseMethod, Tables
from ctxcache.methods.budget import Budget
from ctxcache.methods.csattention import PAPER_PARAMS, CSAttention, CSAttentionParams
from ctxcache.methods.ctkvr import CTkvr
from ctxcache.methods.key_kmeans import KeyKMeans
from ctxcache.methods.magicpig import MagicPIG
from ctxcache.methods.multipole import Multipole
from ctxcache.methods.oracle import Oracle
from ctxcache.methods.prehoc import Prehoc
from ctxcache.methods.quest import Quest

METHODS: dict[str, type[SparseMethod]] = {cls.name: cls for cls in (
    CSAttention, Oracle, KeyKMeans, MagicPIG, CTkvr, Prehoc, Multipole, Quest)}


def make_method(name: str, params: dict[str, Any] | None = None) -> SparseMethod:
    """Instantiate a registered method with validated parameters (ValueError names the problem)."""
    if name == "csattention-paper":
        merged = {**PAPER_PARAMS.to_dict(), **(params or {})}
        return CSAttention(CSAttentionParams.from_dict(merged))
    cls = METHODS.get(name)
    if cls is None:
        raise ValueError(f"unknown method {name!r}; known: {sorted([*METHODS, 'csattention-paper'])}")
    return cls(cls.Params.from_dict(params))


__all__ = ["Budget", "Capabilities", "CSAttention", "CSAttentionParams", "LayerState", "METHODS",
           "MethodParams", "SparseMethod", "Tables", "make_method"]
