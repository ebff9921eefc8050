"""The cache resource (Gemini's cachedContents): create, get, list, update the TTL, delete.
Knows no web framework; a body becomes the PutContextRequest the gRPC front receives and is
validated and identified by the same code, so both fronts give one text the same id."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ctxcache.client.gen.v1 import context_pb2 as pb
from ctxcache.service import contexts, convert
from ctxcache.service.auth import Caller
from ctxcache.indexer.build_queue import BuildQueue
from ctxcache.errors import InvalidArgument, NotFound
from ctxcache.decoder.generate_streams import GenerateStreams
from ctxcache.service.http.generation import context_reference
from ctxcache.service.http.protocol import CachedContentCreate, CachedContentUpdate
from ctxcache.service.http.shapes import cached_content
from ctxcache.service.rpc.calls import in_thread
from ctxcache.service.rpc.servicer import context_info, info_from_manifest, wait_for


def put_request(body: CachedContentCreate) -> pb.PutContextRequest:
    given = [name for name in ("text", "messages", "documents") if getattr(body, name) is not None]
    if len(given) != 1:
        raise InvalidArgument("content", f"give exactly one of text, messages, documents (got {given or 'none'})")
    req = pb.PutContextRequest(labels=body.labels, ttl_seconds=body.ttl or 0, pin=body.pin, wait=body.wait,
                               tenant=body.tenant, kv_codec=body.codec, keep_queries=body.keep_queries)
    if body.text is not None:
        req.text = body.text
    elif body.messages is not None:
        req.chat.messages.extend(pb.ChatMessage(**m.plain()) for m in body.messages)
        req.chat.SetInParent()  # an empty list is still "chat", refused by name below
    else:
        req.documents.documents.extend(pb.Document(text=d.text, title=d.title, id=d.id) for d in body.documents)
        req.documents.SetInParent()
    method = body.method
    if isinstance(method, str):
        req.method.name = method
    elif method is not None:
        req.method.name = method.name
        req.method.params.update(_params(method.params))
    return req


def _params(params: dict[str, Any]) -> dict[str, Any]:
    """JSON numbers become Struct doubles; integers past 2**53 would silently change there."""
    for key, value in params.items():
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 2**53:
            raise InvalidArgument(f"method.params.{key}", f"{value} is too large")
    return params


class CachedContents:
    def __init__(self, indexer: BuildQueue, decoder: GenerateStreams, pool: ThreadPoolExecutor) -> None:
        self.indexer, self.decoder, self.pool = indexer, decoder, pool

    async def create(self, caller: Caller, body: CachedContentCreate) -> dict[str, Any]:
        s = self.indexer.settings
        try:
            request = put_request(body)
        except (ValueError, TypeError) as exc:  # a Struct that cannot hold a value (nesting, types)
            raise InvalidArgument("method.params", str(exc)) from None
        spec = convert.put_spec(request, s.method, s.method_params, caller.tenant, self.indexer.max_tokens,
                                default_codec=s.kv_codec)
        cid, job, created = await in_thread(self.pool, self.indexer.submit, spec)
        if spec.wait:
            await wait_for(job)
        info = await in_thread(self.pool, context_info, self.indexer, cid)
        return {**cached_content(info), "created": created}

    async def get(self, caller: Caller, name: str) -> dict[str, Any]:
        cid = context_reference(name)
        info = await in_thread(self.pool, lambda: context_info(self.indexer,
                                                               contexts.visible(self.indexer, caller, cid)))
        return cached_content(info)

    async def list(self, caller: Caller, page_size: int, page_token: str) -> dict[str, Any]:
        if not 0 <= page_size <= convert.MAX_PAGE:
            raise InvalidArgument("page_size", f"{page_size} must be in [0, {convert.MAX_PAGE}]")
        size, after = convert.page(pb.ListContextsRequest(page_size=page_size, page_token=page_token))
        ms = await in_thread(self.pool, self.indexer.backend.list, size + 1, after or None, caller.tenant)
        page = ms[:size]
        return {"object": "list", "cached_contents": [cached_content(info_from_manifest(m)) for m in page],
                "next_page_token": page[-1].context_id if len(ms) > size else ""}

    async def update(self, caller: Caller, name: str, body: CachedContentUpdate) -> dict[str, Any]:
        cid = context_reference(name)
        m = await in_thread(self.pool, contexts.set_ttl, self.indexer, caller, cid, body.ttl)
        return cached_content(info_from_manifest(m))

    async def delete(self, caller: Caller, name: str) -> dict[str, Any]:
        cid = context_reference(name)
        if not await in_thread(self.pool, contexts.delete, self.indexer, self.decoder, caller, cid):
            raise NotFound(f"context {cid} not found")
        return {"id": cid, "name": f"cachedContents/{cid}", "object": "cached_content.deleted", "deleted": True}
