"""Offline indexing: prefill a context with the model and build sparse-attention tables."""

from ctxcache.indexer.build import IndexerConfig, build_artifact, prefill_chunk, query_positions, reindex

__all__ = ["IndexerConfig", "build_artifact", "prefill_chunk", "query_positions", "reindex"]
