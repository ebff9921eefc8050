"""One access-log line per RPC: method, context id, status, duration (never any content).

The outermost interceptor, so it sees every call, the refused ones too (authentication, a
request that does not parse). It receives requests as the next interceptor hands them over
(ParseInterceptor parses later, so usually raw bytes): the context id is read from those bytes
with the method's request type, or from the response where the request names none (PutContext).
Health checks log at DEBUG: load balancers call them every few seconds.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.message import Message

from ctxcache.client.gen.v1 import admin_pb2, context_pb2

log = logging.getLogger("ctxcache.access")
HEALTH = "/grpc.health.v1.Health/"


def _request_types() -> dict[str, type[Message]]:
    """/package.Service/Method -> its request class, for requests that name a context_id."""
    found = {}
    for file in (context_pb2.DESCRIPTOR, admin_pb2.DESCRIPTOR):
        for service in file.services_by_name.values():
            for m in service.methods:
                if "context_id" in m.input_type.fields_by_name:
                    found[f"/{service.full_name}/{m.name}"] = message_factory.GetMessageClass(m.input_type)
    return found


def context_id_of(request: Any, response: Any, parse: type[Message] | None) -> str:
    cid = ""
    if isinstance(request, Message):
        cid = getattr(request, "context_id", "")
    elif parse is not None and isinstance(request, bytes):
        try:
            cid = parse.FromString(request).context_id
        except Exception:  # noqa: BLE001 - a request that does not parse names no context
            cid = ""
    if not cid and isinstance(response, Message):
        info = getattr(response, "context", response)
        cid = getattr(info, "context_id", "")
    return cid[:64] or "-"


def _status(context: grpc.aio.ServicerContext, exc: BaseException | None) -> str:
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    if exc is None:
        return "OK"
    return "CANCELLED" if isinstance(exc, (asyncio.CancelledError, GeneratorExit)) else "UNKNOWN"


class AccessLogInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self) -> None:
        self._types = _request_types()

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method
        level = logging.DEBUG if method.startswith(HEALTH) else logging.INFO
        if not log.isEnabledFor(level):
            return handler
        write = _Line(method, level, self._types.get(method))
        kw = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(write.unary(handler.unary_unary), **kw)
        if handler.unary_stream is not None and inspect.isasyncgenfunction(handler.unary_stream):
            return grpc.unary_stream_rpc_method_handler(write.stream(handler.unary_stream), **kw)
        return handler  # streaming requests (reflection) and context.write streams (health Watch)


class _Line:
    """Times one method's calls and writes their lines."""

    def __init__(self, method: str, level: int, parse: type[Message] | None) -> None:
        self.method, self.level, self.parse = method.lstrip("/"), level, parse

    def write(self, context, request: Any, response: Any, exc: BaseException | None, t0: float) -> None:
        log.log(self.level, "%s %s %s %.1f ms", self.method, context_id_of(request, response, self.parse),
                _status(context, exc), (time.perf_counter() - t0) * 1e3)

    def unary(self, inner: Callable) -> Callable:
        async def call(request, context):
            t0, response, failure = time.perf_counter(), None, None
            try:
                response = await inner(request, context)
                return response
            except BaseException as exc:
                failure = exc
                raise
            finally:
                self.write(context, request, response, failure, t0)
        return call

    def stream(self, inner: Callable) -> Callable:
        async def call(request, context):
            t0, failure = time.perf_counter(), None
            try:
                async for item in inner(request, context):
                    yield item
            except BaseException as exc:
                failure = exc
                raise
            finally:
                self.write(context, request, None, failure, t0)
        return call
