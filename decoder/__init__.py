"""The decoder, online: decoding from cached artifacts with sparse attention. The engine and its
admission, scheduler and in-flight batches (engine.py, admission.py, scheduler.py, inflight.py),
the runners (runner.py: the reference path; gpu/: the fast GPU path and the offload runner),
sessions and decode modes; loading on demand (artifact_cache.py: stored artifacts loaded into
memory, one load per context, evicted by bytes), the cached context a stream decodes after
(cached_context.py; uncached.py: the empty one), text streamed from tokens (textstream.py), and
the Generate streams over all of it (generate_streams.py; what a Generate asks and its stream
yields: stream_spec.py). In a fleet: a decoder's presence, its heartbeat of the contexts it holds
hot (fleet_presence.py)."""

from ctxcache.decoder.session import ArtifactMismatch, generate, start_batch
from ctxcache.decoder.reference_attention import ReferenceSparseAttention, SparseConfig

__all__ = ["ArtifactMismatch", "ReferenceSparseAttention", "SparseConfig", "generate", "start_batch"]
