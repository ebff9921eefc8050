"""The indexer, offline: a context prefilled with the model and its sparse-attention tables built
(build.py), and the pipeline around it. The build queue (build_queue.py: PutContext's builds,
queued, admitted by cost, fair across tenants) and the turns builds take on the device
(build_turns.py); a build's spec and its JSON on the job stream (job_spec.py); its settings
(settings.py). In a fleet: the indexer's loop over the job stream (fleet_indexer.py), its upkeep
of the shared tier (fleet_janitor.py), and a decoder's builds, enqueued for the indexers
(remote_builds.py). What it uses of the service's Backend is named in seams.py."""

from ctxcache.indexer.build import IndexerConfig, build_artifact, prefill_chunk, query_positions, reindex

__all__ = ["IndexerConfig", "build_artifact", "prefill_chunk", "query_positions", "reindex"]
