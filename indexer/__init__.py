"""The indexer, offline: a context prefilled with the model and its sparse-attention tables built
(build.py), and the turns that builds take on the device, one tenant at a time (build_turns.py).
The build queue, job specs and the fleet indexer's loop still live in service/ (issue 49's
remainder: they import the service's errors, metrics and config)."""

from ctxcache.indexer.build import IndexerConfig, build_artifact, prefill_chunk, query_positions, reindex

__all__ = ["IndexerConfig", "build_artifact", "prefill_chunk", "query_positions", "reindex"]
