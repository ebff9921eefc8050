"""Sparse-attention methods behind one interface, and the registry that names them."""

from __future__ import annotations

from typing import Any

from ctxcache.methods.base import Capabilities, LayerState, MethodParams, ParamError, SparseMethod, Tables
from ctxcache.methods.budget import Budget
from ctxcache.methods.csattention import CSAttention, CSAttentionParams
from ctxcache.methods.ctkvr import CTkvr
from ctxcache.methods.key_kmeans import KeyKMeans
from ctxcache.methods.magicpig import MagicPIG
from ctxcache.methods.multipole import Multipole
from ctxcache.methods.oracle import Oracle
from ctxcache.methods.prehoc import Prehoc
from ctxcache.methods.quest import Quest

METHODS: dict[str, type[SparseMethod]] = {cls.name: cls for cls in (
    CSAttention, Oracle, KeyKMeans, MagicPIG, CTkvr, Prehoc, Multipole, Quest)}


# Named parameter sets of a registered method: name -> (base method, parameter overrides).
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    # CSAttention as the paper describes it: N/4 Top-L lists, unit weights, absolute scores
    "csattention-paper": ("csattention", {"list_fraction": 0.25, "weighting": "unit", "scoring": "absolute"}),
}


def method_names() -> list[str]:
    """Every name make_method takes: the registered methods and the presets."""
    return sorted([*METHODS, *PRESETS])


def make_method(name: str, params: dict[str, Any] | None = None) -> SparseMethod:
    """Instantiate a registered method or preset with validated parameters (ValueError names
    the problem); a preset's overrides come first, `params` on top of them."""
    if name in PRESETS:
        name, overrides = PRESETS[name]
        params = {**overrides, **(params or {})}
    cls = METHODS.get(name)
    if cls is None:
        raise ValueError(f"unknown method {name!r}; known: {method_names()}")
    return cls(cls.Params.from_dict(params))


__all__ = ["Budget", "Capabilities", "CSAttention", "CSAttentionParams", "LayerState", "METHODS",
           "MethodParams", "ParamError", "PRESETS", "SparseMethod", "Tables", "make_method", "method_names"]
