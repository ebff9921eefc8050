"""Online decoding from cached artifacts with sparse attention."""

from ctxcache.decoder.session import ArtifactMismatch, generate, start_batch
from ctxcache.decoder.sparse_attention import SparseAttention, SparseConfig

__all__ = ["ArtifactMismatch", "SparseAttention", "SparseConfig", "generate", "start_batch"]
