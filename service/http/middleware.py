"""ASGI middleware of the HTTP front: who is calling and how much it sends, before any routing
or body parsing (as the gRPC front authenticates before method lookup), and Prometheus metrics
of every request."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ctxcache.service.auth import Auth, Caller
from ctxcache.errors import Unauthenticated, Unavailable
from ctxcache.service.http.errors import ErrorResponse, envelope, error_response

OPEN_PATHS = ("/health",)  # load balancers probe without a token, as gRPC health checks do
_CALLER = "ctxcache.caller"
_METHODS = {"GET", "POST", "PATCH", "DELETE", "PUT", "HEAD", "OPTIONS"}


def caller_of(request: Request) -> Caller:
    return request.scope[_CALLER]


class Guard:
    """Bearer token -> Caller (the gRPC front's tokens and tenants), 503 while draining, 413
    for a body over the limit (counted, not trusted from a header, when it comes chunked)."""

    def __init__(self, app: ASGIApp, auth: Auth, draining: Callable[[], bool], max_body_bytes: int) -> None:
        self.app, self.auth, self.draining, self.max_body = app, auth, draining, max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        caller = self.auth.caller([("authorization", headers.get(b"authorization", b""))])
        refusal = None
        if caller is None:
            refusal = error_response(Unauthenticated("authorization: missing or wrong bearer token"))
        elif self.draining():
            refusal = error_response(Unavailable("the server is shutting down; retry on another worker"))
        length = headers.get(b"content-length")
        if refusal is None and length is not None and (not length.isdigit() or int(length) > self.max_body):
            refusal = self._too_large()
        if refusal is None and length is None and headers.get(b"transfer-encoding"):
            receive, refusal = await self._buffered(receive)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        scope[_CALLER] = caller
        await self.app(scope, receive, send)

    def _too_large(self) -> ErrorResponse:
        return ErrorResponse(envelope(413, f"request body over {self.max_body} bytes", code="request_too_large"), 413)

    async def _buffered(self, receive: Receive) -> tuple[Receive, ErrorResponse | None]:
        """A chunked body, read up to the limit, then replayed to the app."""
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return receive, ErrorResponse(envelope(400, "the client went away"), 400)
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body:
                return receive, self._too_large()
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes
        return replay, None


class HttpMetricSet:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter("ctxcache_http_requests", "HTTP requests by method, route and status",
                                ["method", "route", "status"], registry=registry)
        self.seconds = Histogram("ctxcache_http_request_seconds", "HTTP request time until its response "
                                 "ends (a stream: its whole life)", ["method", "route"],
                                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
                                 registry=registry)


class HttpMetrics:
    """Counts every request (refused ones too) by its route's template, never its raw path."""

    def __init__(self, app: ASGIApp, metrics: HttpMetricSet) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [500]

        async def sent(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)
        t0 = time.perf_counter()
        try:
            await self.app(scope, receive, sent)
        finally:
            method = scope["method"] if scope["method"] in _METHODS else "OTHER"
            route: Any = scope.get("route")
            name = getattr(route, "path", None) or "unmatched"
            self.metrics.requests.labels(method, name, str(status[0])).inc()
            self.metrics.seconds.labels(method, name).observe(time.perf_counter() - t0)
