"""grpc.aio plumbing: an event loop on its own thread, blocking work on a thread pool, errors
mapped once (errors.status_for).

Why aio: a synchronous grpcio server runs every RPC on a pool thread for its whole life, so
70 PutContext(wait=true) calls held 64 threads for their builds and an unrelated Stats call
waited 13.7 s. Here a waiting Put is a coroutine (no thread); blocking calls (tokenizing,
LMDB, torch) run on `pool` only while they compute, and a Generate stream holds one pool
thread while it decodes (at most --max-streams of them).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc

from ctxcache.service.errors import status_for
from ctxcache.store import request_deadline

log = logging.getLogger("ctxcache.service.rpc")
T = TypeVar("T")
MAX_DETAILS = 1000  # status details are cut: an echoed 64 KB value must not overflow the metadata


class LoopThread:
    """An asyncio loop running forever on a daemon thread; `run` submits and waits."""

    def __init__(self, name: str = "ctxcache-aio") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Awaitable[T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(5)
        if not self.loop.is_running():
            self.loop.close()


def cut(message: str) -> str:
    return message if len(message) <= MAX_DETAILS else message[:MAX_DETAILS] + "... (cut)"


async def abort(context: grpc.aio.ServicerContext, exc: BaseException, admin: bool = False) -> None:
    code, message = status_for(exc, admin)
    await context.abort(code, cut(message))


def _admin(servicer: Any, context: grpc.aio.ServicerContext) -> bool:
    """Whether the caller may read addresses in errors: an admin credential (or an open server).
    A servicer without `auth` is AdminService, which the interceptor opens to admins only."""
    auth = getattr(servicer, "auth", None)
    if auth is None:
        return True
    caller = auth.caller(context.invocation_metadata())
    return caller is not None and caller.admin


def deadline_of(context: grpc.aio.ServicerContext) -> float | None:
    """The call's deadline as time.monotonic(), None if the client set none."""
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


def unary(fn: Callable) -> Callable:
    """Async unary handler: a domain error becomes its status; never UNKNOWN. The call's
    deadline bounds its object-store calls (in_thread carries it to the pool)."""
    @functools.wraps(fn)
    async def wrapper(self, request, context):
        try:
            with request_deadline(deadline_of(context)):
                return await fn(self, request, context)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped, never leaked as UNKNOWN
            if isinstance(exc, grpc.RpcError) or _aborted(exc):
                raise
            failure = exc
        await abort(context, failure, _admin(self, context))
    return wrapper


def streaming(fn: Callable) -> Callable:
    @functools.wraps(fn)
    async def wrapper(self, request, context):
        try:
            async for item in fn(self, request, context):
                yield item
            return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001
            if isinstance(exc, grpc.RpcError) or _aborted(exc):
                raise
            failure = exc
        await abort(context, failure, _admin(self, context))
    return wrapper


def _aborted(exc: BaseException) -> bool:
    return type(exc).__name__ == "AbortError"  # grpc.aio's abort() raises it; let it through


async def in_thread(pool: ThreadPoolExecutor, fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) on the pool, in a copy of this context (the request's store deadline with it)."""
    run = contextvars.copy_context().run
    return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(run, fn, *args))


_END = object()


async def iterate_in_thread(pool: ThreadPoolExecutor, make: Callable[[Callable[[], bool]], Iterator[T]]
                            ) -> AsyncIterator[T]:
    """Run the blocking iterator make(alive) on a pool thread; yield its items here. When the
    consumer stops (client cancelled, deadline, drain), alive() turns False so the producer
    stops at its next check instead of decoding for nobody."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    stopped = threading.Event()

    def produce() -> None:
        try:
            for item in make(lambda: not stopped.is_set()):
                loop.call_soon_threadsafe(queue.put_nowait, (item, None))
                if stopped.is_set():
                    break
            loop.call_soon_threadsafe(queue.put_nowait, (_END, None))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            loop.call_soon_threadsafe(queue.put_nowait, (_END, exc))

    loop.run_in_executor(pool, contextvars.copy_context().run, produce)
    try:
        while True:
            item, exc = await queue.get()
            if exc is not None:
                raise exc
            if item is _END:
                return
            yield item
    finally:
        stopped.set()  # never wait for the producer here: it sees alive() turn False and ends


class ParseInterceptor(grpc.aio.ServerInterceptor):
    """Request bytes that do not parse (truncated, garbage, invalid UTF-8, nested past the
    parser's depth) are the caller's fault: INVALID_ARGUMENT, not grpcio's INTERNAL
    "Exception deserializing request!". The handler receives raw bytes and parses them here."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer

        async def parsed(raw: bytes, context):
            try:
                return parse(raw)
            except Exception as exc:  # noqa: BLE001 - DecodeError, RecursionError, UnicodeDecodeError
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    cut(f"request: cannot be parsed ({type(exc).__name__}: {exc})"))

        if handler.response_streaming:
            inner = handler.unary_stream
            if not inspect.isasyncgenfunction(inner):  # health Watch writes via context.write
                return handler

            async def stream(raw, context):
                request = await parsed(raw, context)
                async for item in inner(request, context):
                    yield item
            return grpc.unary_stream_rpc_method_handler(stream, response_serializer=handler.response_serializer)
        inner_unary = handler.unary_unary

        async def unary_call(raw, context):
            request = await parsed(raw, context)
            return await inner_unary(request, context)
        return grpc.unary_unary_rpc_method_handler(unary_call, response_serializer=handler.response_serializer)
