"""Online decoding from cached artifacts with sparse attention."""

from ctxcache.decoder.session import ArtifactMismatch, generate, start_batch
from ctxcache.decoder.reference_attention import ReferenceSparseAttention, SparseConfig

__all__ = ["ArtifactMismatch", "ReferenceSparseAttention", "SparseConfig", "generate", "start_batch"]
