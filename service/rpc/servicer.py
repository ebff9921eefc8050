"""Thin async servicers (grpc.aio): proto in, domain call on the pool, proto out. Errors are
mapped in errors.py only; the caller's tenant scopes every read."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from ctxcache.service import contexts, convert
from ctxcache.service.auth import Auth, Caller
from ctxcache.decoder.generate_streams import GenerateStreams
from ctxcache.decoder.stream_spec import Chunk, Final
from ctxcache.errors import NotFound, Unauthenticated, Unavailable
from ctxcache.service.rpc.calls import deadline_of, in_thread, iterate_in_thread, streaming, unary
from ctxcache.client.gen.v1 import context_pb2 as pb, context_pb2_grpc
from ctxcache.indexer.build_queue import BuildQueue, Job
from ctxcache.store import CorruptArtifact, Manifest, StoreUnavailable, request_deadline
from ctxcache.store.registries.fleet_registry import Facts

_STATE = {"building": pb.CONTEXT_STATE_BUILDING, "ready": pb.CONTEXT_STATE_READY,
          "failed": pb.CONTEXT_STATE_FAILED}
_FINISH = {"stop": pb.FINISH_REASON_STOP, "stop_sequence": pb.FINISH_REASON_STOP_SEQUENCE,
           "length": pb.FINISH_REASON_LENGTH, "context_limit": pb.FINISH_REASON_CONTEXT_LIMIT}


def info_from_manifest(m: Manifest) -> pb.ContextInfo:
    labels = {k: v for k, v in m.labels.items() if not k.startswith(convert.RESERVED_LABEL)}
    return pb.ContextInfo(
        context_id=m.context_id, state=pb.CONTEXT_STATE_READY, progress=1.0, n_tokens=m.n_tokens,
        method=m.method, method_params=convert.dict_to_struct(m.method_params), labels=labels,
        pin=m.pinned, ttl_seconds=int(m.ttl_s or 0), created_unix_ms=int(m.created_at * 1000),
        artifact_bytes=m.stored_bytes, raw_kv_bytes=m.raw_kv_bytes, model_id=m.model_id,
        kv_codec=m.kv_codec, format_version=m.format_version)


def info_from_job(job: Job, model_id: str) -> pb.ContextInfo:
    s = job.spec
    return pb.ContextInfo(
        context_id=job.context_id, state=_STATE[job.state], progress=job.progress, error=job.error,
        n_tokens=len(job.tokens), method=s.method, method_params=convert.dict_to_struct(s.method_params),
        labels=s.labels, pin=s.pin, ttl_seconds=int(s.ttl_s or 0), model_id=model_id, kv_codec=s.kv_codec)


def info_from_damage(f: Facts) -> pb.ContextInfo:
    """A context whose manifest fails its check: what the fleet's registry knows of it."""
    return pb.ContextInfo(context_id=f.context_id, state=pb.CONTEXT_STATE_DAMAGED, error=f.error or "damaged",
                          n_tokens=f.n_tokens)


def context_info(indexer: BuildQueue, cid: str) -> pb.ContextInfo:
    """A stored manifest wins over a job record (a job may lag its own completion); DAMAGED (the
    registry's mark) over a stored manifest."""
    try:
        m = indexer.backend.manifest(cid)
    except CorruptArtifact:
        damage = indexer.backend.damage(cid)
        if not damage:
            raise  # not marked (the registry unavailable): DATA_LOSS
        return pb.ContextInfo(context_id=cid, state=pb.CONTEXT_STATE_DAMAGED, error=damage)
    if m is not None:
        info = info_from_manifest(m)
        facts = indexer.backend.fleet_facts(cid)  # a fleet's: the object's URI, the workers holding it hot
        if facts is not None:
            info.artifact_uri = facts.artifact_uri
            info.hot_workers.extend(facts.hot_workers)
        damage = facts.damage if facts is not None else indexer.backend.damage(cid)
        if damage:  # a chunk failed its check
            info.state, info.error, info.progress = pb.CONTEXT_STATE_DAMAGED, damage, 0.0
        return info
    job = indexer.job(cid)
    if job is None:
        raise NotFound(f"context {cid} not found")
    return info_from_job(job, indexer.lm.model_id)


def unstored_jobs(indexer: BuildQueue) -> list[Job]:
    """Builds still building, or failed, that have no stored artifact (a READY job is in the store)."""
    jobs = indexer.jobs()
    return [j for j in jobs if j.state != "ready" and not _stored(indexer, j.context_id)]


def _stored(indexer: BuildQueue, cid: str) -> bool:
    try:
        return indexer.backend.manifest(cid) is not None
    except CorruptArtifact:
        return True  # listed as DAMAGED, not as a build


async def wait_for(job: Job | None) -> None:
    """Wait for a build without holding a thread; a cancelled RPC cancels this coroutine."""
    while job is not None and not job.done.is_set():
        await asyncio.sleep(0.05)


class ContextServicer(context_pb2_grpc.ContextServiceServicer):
    def __init__(self, indexer: BuildQueue, decoder: GenerateStreams, default_max_tokens: int,
                 max_tokens_limit: int, pool: ThreadPoolExecutor, auth: Auth,
                 draining: Callable[[], bool] = lambda: False) -> None:
        self.indexer, self.decoder, self.pool, self.auth = indexer, decoder, pool, auth
        self.default_max, self.limit, self.draining = default_max_tokens, max_tokens_limit, draining

    def _caller(self, context) -> Caller:
        caller = self.auth.caller(context.invocation_metadata())
        if caller is None:  # the interceptor refuses these first; kept for servers built without it
            raise Unauthenticated("authorization: missing or wrong bearer token")
        if self.draining():
            raise Unavailable("the server is shutting down; retry on another worker")
        return caller

    @unary
    async def PutContext(self, request, context):
        caller = self._caller(context)
        s = self.indexer.settings
        spec = convert.put_spec(request, s.method, s.method_params, caller.tenant, self.indexer.max_tokens,
                                s.kv_codec, self.indexer.prompter.message_tokens)
        cid, job, created = await in_thread(self.pool, self.indexer.submit, spec)
        if spec.wait:
            await wait_for(job)
            if job is not None and job.token.cancelled and self.draining():  # the build ended with the server
                raise Unavailable("the server is shutting down; retry on another worker or after its restart")
        try:
            info = await in_thread(self.pool, context_info, self.indexer, cid)
        except StoreUnavailable:
            if job is None or job.state != "failed":
                raise
            # the store that failed this build's upload still refuses calls (its breaker is open):
            # the answer is the build's own failure, not a second outage report
            info = info_from_job(job, self.indexer.lm.model_id)
        return pb.PutContextResponse(context=info, created=created)

    @unary
    async def GetContext(self, request, context):
        caller = self._caller(context)
        cid = convert.context_id(request.context_id)
        return await in_thread(self.pool, lambda: context_info(self.indexer,
                                                               contexts.visible(self.indexer, caller, cid)))

    @unary
    async def ListContexts(self, request, context):
        caller = self._caller(context)
        size, after = convert.page(request)
        infos = await in_thread(self.pool, self._list, size, after, caller)
        more = len(infos) > size
        infos = infos[:size]
        return pb.ListContextsResponse(contexts=infos, next_page_token=infos[-1].context_id if more else "")

    def _list(self, size: int, after: str, caller: Caller) -> list[pb.ContextInfo]:
        """Stored contexts and this worker's unstored builds (BUILDING, FAILED) in id order: the
        first size + 1 after `after`. Every build is merged, so a page misses none of either."""
        ms = self.indexer.backend.list(size + 1, after or None, caller.tenant)
        stored = {m.context_id for m in ms}
        jobs = [j for j in unstored_jobs(self.indexer) if j.context_id > after and j.context_id not in stored
                and caller.sees(j.spec.tenant)]
        infos = {m.context_id: info_from_manifest(m) for m in ms}
        infos.update((j.context_id, info_from_job(j, self.indexer.lm.model_id)) for j in jobs)
        for f in self.indexer.backend.damaged():  # a fleet's DAMAGED contexts, readable manifest or not
            if f.context_id > after and caller.sees(f.tenant):
                info = infos.setdefault(f.context_id, info_from_damage(f))
                info.state, info.error, info.progress = pb.CONTEXT_STATE_DAMAGED, f.error or "damaged", 0.0
        return sorted(infos.values(), key=lambda i: i.context_id)[:size + 1]

    @unary
    async def DeleteContext(self, request, context):
        caller = self._caller(context)
        cid = convert.context_id(request.context_id)
        deleted = await in_thread(self.pool, contexts.delete, self.indexer, self.decoder, caller, cid)
        return pb.DeleteContextResponse(deleted=deleted)

    @streaming
    async def Generate(self, request, context):
        t0 = time.perf_counter()
        caller = self._caller(context)
        spec = convert.generate_spec(request, self.default_max, self.limit, self.indexer.lm.args.max_seq_len,
                                     self.indexer.prompter.message_tokens)
        deadline = deadline_of(context)
        with request_deadline(deadline):  # a cold manifest read ends by it (the stream's load: stream())
            await in_thread(self.pool, contexts.check_readable, self.indexer, caller, spec.context_id)
        events = iterate_in_thread(self.pool, lambda alive: self.decoder.stream(spec, alive, deadline, t0))
        async for event in events:
            yield _response(event)


def _response(event: Chunk | Final) -> pb.GenerateResponse:
    if isinstance(event, Chunk):
        return pb.GenerateResponse(chunk=pb.Chunk(text=event.text, token_ids=event.token_ids))
    return pb.GenerateResponse(final=pb.Final(
        usage=pb.Usage(cached_tokens=event.cached_tokens, new_prompt_tokens=event.new_prompt_tokens,
                       generated_tokens=event.generated_tokens),
        timings=pb.Timings(ttft_seconds=event.ttft_seconds, tokens_per_second=event.tokens_per_second,
                           load_seconds=event.load_seconds, total_seconds=event.total_seconds,
                           cache_hit=event.cache_hit),
        decode_path=event.decode_path, finish_reason=_FINISH[event.finish_reason], text=event.text))
