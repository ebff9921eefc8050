"""Thin servicers: proto in, domain call, proto out. Errors are mapped in errors.py only."""

from __future__ import annotations

import time

import grpc

from ctxcache.service import convert
from ctxcache.service.generate_streams import Chunk, GenerateStreams
from ctxcache.service.errors import NotFound, unary, streaming
from ctxcache.service.gen.v1 import context_pb2 as pb, context_pb2_grpc
from ctxcache.service.build_queue import BuildQueue, Job
from ctxcache.store import Manifest

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


def context_info(indexer: BuildQueue, cid: str) -> pb.ContextInfo:
    """A stored manifest wins over a job record (a job may lag its own completion)."""
    m = indexer.backend.manifest(cid)
    if m is not None:
        return info_from_manifest(m)
    job = indexer.job(cid)
    if job is None:
        raise NotFound(f"context {cid} not found")
    return info_from_job(job, indexer.lm.model_id)


def wait_while_client_waits(job: Job | None, context: grpc.ServicerContext) -> None:
    """Block until the build job finishes or the client goes away (a cancelled RPC must not pin
    a server thread for the length of a build)."""
    if job is None:
        return
    while not job.done.wait(0.05) and context.is_active():
        pass


class ContextServicer(context_pb2_grpc.ContextServiceServicer):
    def __init__(self, indexer: BuildQueue, decoder: GenerateStreams, default_max_tokens: int,
                 max_tokens_limit: int) -> None:
        self.indexer, self.decoder = indexer, decoder
        self.default_max, self.limit = default_max_tokens, max_tokens_limit

    @unary
    def PutContext(self, request, context):
        s = self.indexer.settings
        spec = convert.put_spec(request, s.method, s.method_params, s.kv_codec)
        cid, job, created = self.indexer.submit(spec)
        if spec.wait:
            wait_while_client_waits(job, context)
        return pb.PutContextResponse(context=context_info(self.indexer, cid), created=created)

    @unary
    def GetContext(self, request, context):
        return context_info(self.indexer, convert.context_id(request.context_id))

    @unary
    def ListContexts(self, request, context):
        size, after = convert.page(request)
        ms = self.indexer.backend.list(size + 1, after or None)
        more = len(ms) > size
        ms = ms[:size]
        return pb.ListContextsResponse(contexts=[info_from_manifest(m) for m in ms],
                                       next_page_token=ms[-1].context_id if more else "")

    @unary
    def DeleteContext(self, request, context):
        cid = convert.context_id(request.context_id)
        deleted = self.indexer.backend.delete(cid)  # store first, then DRAM (see Evict)
        self.decoder.evict(cid)
        return pb.DeleteContextResponse(deleted=deleted)

    @streaming
    def Generate(self, request, context):
        t0 = time.perf_counter()
        spec = convert.generate_spec(request, self.default_max, self.limit)
        remaining = context.time_remaining()
        deadline = time.monotonic() + remaining if remaining is not None else None
        for event in self.decoder.stream(spec, context.is_active, deadline, t0):
            if isinstance(event, Chunk):
                yield pb.GenerateResponse(chunk=pb.Chunk(text=event.text, token_ids=event.token_ids))
                continue
            yield pb.GenerateResponse(final=pb.Final(
                usage=pb.Usage(cached_tokens=event.cached_tokens, new_prompt_tokens=event.new_prompt_tokens,
                               generated_tokens=event.generated_tokens),
                timings=pb.Timings(ttft_seconds=event.ttft_seconds, tokens_per_second=event.tokens_per_second,
                                   load_seconds=event.load_seconds, total_seconds=event.total_seconds,
                                   cache_hit=event.cache_hit),
                decode_path=event.decode_path,
                finish_reason=_FINISH[event.finish_reason], text=event.text))
