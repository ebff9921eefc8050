"""The router: FastAPI routes that parse a body, call a handler and shape the answer. Who is
calling (bearer tokens), body size and metrics are ASGI middleware (middleware.py), so they run
before any routing or parsing; every failure leaves in the one error shape (errors.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response

from ctxcache.errors import Cancelled, PermissionDenied
from ctxcache.service.http.cached import CachedContents
from ctxcache.service.http.errors import error_response, http_response, validation_response
from ctxcache.service.http.generation import Generation
from ctxcache.service.http.middleware import Guard, HttpMetrics, HttpMetricSet, caller_of
from ctxcache.service.http.protocol import (CachedContentCreate, CachedContentUpdate, ChatCompletionRequest,
                                            CompletionRequest, DetokenizeRequest, TokenizeRequest)
from ctxcache.service.http.tokens import Tokens

PING_S = 15  # SSE keep-alive comments for proxies that close idle connections


async def _unless_gone(request: Request, work: Callable[[], Awaitable[Any]]) -> Any:
    """The work, cancelled if the client disconnects first (vLLM's with_cancellation): a whole
    answer nobody waits for stops decoding. A stream is watched by its response once it starts."""
    task = asyncio.ensure_future(work())
    gone = asyncio.ensure_future(_disconnected(request))
    await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        gone.cancel()
        return task.result()
    task.cancel()
    raise Cancelled("the client went away")


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _answer(work: Callable[[], Awaitable[Any]], request: Request | None = None) -> Response:
    """A handler's dict as JSON, its async iterator as server-sent events, its error as the
    error shape with the status the error maps to. request: cancel the work if its client leaves."""
    try:
        result = await (work() if request is None else _unless_gone(request, work))
    except Exception as exc:  # noqa: BLE001 - mapped in errors.py, never a bare 500
        return error_response(exc)
    if isinstance(result, AsyncIterator):
        return EventSourceResponse(result, ping=PING_S, sep="\n")
    return JSONResponse(result)


async def _now(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


def build_app(generation: Generation, cached: CachedContents, tokens: Tokens, auth, draining: Callable[[], bool],
              ready: Callable[[], bool], metrics, max_body_bytes: int) -> FastAPI:
    """auth: service.auth.Auth (the gRPC front's tokens); ready: warm and serving (gRPC health
    SERVING); metrics: the server's Metrics."""
    app = FastAPI(title="ctxcache", docs_url=None, redoc_url=None)
    app.add_middleware(Guard, auth=auth, draining=draining, max_body_bytes=max_body_bytes)
    app.add_middleware(HttpMetrics, metrics=HttpMetricSet(metrics.registry))
    _errors(app)
    models = generation.models

    @app.get("/health")
    async def health() -> Response:
        if draining() or not ready():
            return JSONResponse({"status": "draining" if draining() else "starting"}, 503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        if not caller_of(request).admin:
            return error_response(PermissionDenied("/metrics needs the admin credential"))
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models() -> Response:
        return JSONResponse(models.cards())

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> Response:
        return await _answer(lambda: _now(models.card, model))

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse(Tokens.version())

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        return await _answer(lambda: tokens.tokenize(body))

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        return await _answer(lambda: tokens.detokenize(body))

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        return await _answer(lambda: generation.chat(caller_of(request), body), request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _answer(lambda: generation.completion(caller_of(request), body), request)

    @app.post("/v1/cached_contents")
    async def create(body: CachedContentCreate, request: Request) -> Response:
        return await _answer(lambda: cached.create(caller_of(request), body))

    @app.get("/v1/cached_contents")
    async def list_(request: Request, page_size: int = 0, page_token: str = "") -> Response:
        return await _answer(lambda: cached.list(caller_of(request), page_size, page_token))

    @app.get("/v1/cached_contents/{name:path}")
    async def get(name: str, request: Request) -> Response:
        return await _answer(lambda: cached.get(caller_of(request), name))

    @app.patch("/v1/cached_contents/{name:path}")
    async def update(name: str, body: CachedContentUpdate, request: Request) -> Response:
        return await _answer(lambda: cached.update(caller_of(request), name, body))

    @app.delete("/v1/cached_contents/{name:path}")
    async def delete(name: str, request: Request) -> Response:
        return await _answer(lambda: cached.delete(caller_of(request), name))

    return app


def _errors(app: FastAPI) -> None:
    """The framework's own refusals in the same shape: 422 is a 400 naming the field."""

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        return validation_response(list(exc.errors()), exc.body)

    @app.exception_handler(HTTPException)
    async def http(request: Request, exc: HTTPException) -> Response:
        return http_response(exc.status_code, exc.detail, exc.headers)
