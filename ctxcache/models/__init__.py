"""Llama-family decoder models in plain torch, with pluggable attention."""

from ctxcache.models.config import NAMED_CONFIGS, ModelArgs
from ctxcache.models.llama import Transformer

__all__ = ["ModelArgs", "NAMED_CONFIGS", "Transformer"]
