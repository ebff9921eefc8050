"""What a caller may do with a context, shared by both fronts (gRPC servicers, HTTP): the same
tenant isolation, states and errors, whichever protocol asked."""

from __future__ import annotations

from ctxcache.service.auth import Caller
from ctxcache.indexer.build_queue import BuildQueue
from ctxcache.errors import FailedPrecondition, InvalidArgument, NotFound
from ctxcache.decoder.generate_streams import GenerateStreams
from ctxcache.store import Manifest


def visible(indexer: BuildQueue, caller: Caller, cid: str) -> str:
    """NOT_FOUND for another tenant's context, as if it were absent."""
    tenant = indexer.tenant_of(cid)
    if tenant is not None and not caller.sees(tenant):
        raise NotFound(f"context {cid} not found")
    return cid


def delete(indexer: BuildQueue, decoder: GenerateStreams, caller: Caller, cid: str) -> bool:
    """-> whether anything was deleted (another tenant's id: False, as if absent)."""
    try:
        visible(indexer, caller, cid)
    except NotFound:
        return False
    cancelled = indexer.cancel(cid, "deleted by DeleteContext")  # a BUILDING id stops building
    deleted = indexer.backend.delete(cid)  # store first, then DRAM (see Evict)
    decoder.evict(cid)
    return deleted or cancelled


def check_readable(indexer: BuildQueue, caller: Caller, cid: str) -> None:
    """Generate may start on cid: visible, and READY in this worker's store."""
    visible(indexer, caller, cid)
    if indexer.backend.manifest(cid) is None:
        job = indexer.job(cid)
        if job is not None and job.state == "building":
            raise FailedPrecondition(f"context {cid} is still BUILDING ({job.progress:.0%}); "
                                     "retry when GetContext says READY")
        raise NotFound(indexer.backend.missing(cid))


def set_ttl(indexer: BuildQueue, caller: Caller, cid: str, ttl_s: float | None) -> Manifest:
    """A stored context's TTL, counted from now (None: no expiry). An expired context stays
    expired: it is absent to every caller, so no tenant can revive another's."""
    if ttl_s is not None and not ttl_s > 0:
        raise InvalidArgument("ttl", f"{ttl_s} must be > 0 seconds (or none: no expiry)")
    check_readable(indexer, caller, cid)
    m = indexer.backend.update_ttl(cid, ttl_s)
    if m is None:
        raise NotFound(f"context {cid} not found")
    return m
