"""The one place where exceptions become gRPC status codes (never UNKNOWN).

Servicer methods raise domain errors (below, or the store's / decoder's own) and are wrapped
by `unary` / `streaming`, which abort the call with the mapped code and message.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator

import grpc

log = logging.getLogger("ctxcache.service")


class ServiceError(Exception):
    code = grpc.StatusCode.INTERNAL


class InvalidArgument(ServiceError):
    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, why: str) -> None:
        super().__init__(f"{field}: {why}")
        self.field = field


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(ServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE


class DataLoss(ServiceError):
    code = grpc.StatusCode.DATA_LOSS


class DeadlineExceeded(ServiceError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unauthenticated(ServiceError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(ServiceError):
    code = grpc.StatusCode.PERMISSION_DENIED


class Cancelled(ServiceError):
    code = grpc.StatusCode.CANCELLED


def _foreign_codes() -> dict[type, grpc.StatusCode]:
    """Errors of other components, imported lazily so this module stays cheap to import."""
    from ctxcache.decoder import ArtifactMismatch
    from ctxcache import store

    codes: dict[type, grpc.StatusCode] = {ArtifactMismatch: grpc.StatusCode.FAILED_PRECONDITION}
    for name, code in (("CorruptArtifact", grpc.StatusCode.DATA_LOSS),
                       ("StoreDamaged", grpc.StatusCode.DATA_LOSS),
                       ("StoreFull", grpc.StatusCode.RESOURCE_EXHAUSTED),
                       ("RegistryUnavailable", grpc.StatusCode.UNAVAILABLE),
                       ("FormatMismatch", grpc.StatusCode.FAILED_PRECONDITION),
                       ("NotFound", grpc.StatusCode.NOT_FOUND)):
        try:
            cls = getattr(store, name)
        except (AttributeError, ImportError):
            continue
        if isinstance(cls, type):
            codes[cls] = code
    return codes


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, ServiceError):
        return exc.code, str(exc)
    for cls, code in _foreign_codes().items():
        if isinstance(exc, cls):
            return code, f"{type(exc).__name__}: {exc}"
    if isinstance(exc, MemoryError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, "out of memory"
    log.exception("internal error", exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


def _abort(context: grpc.ServicerContext, exc: BaseException) -> None:
    code, message = status_for(exc)
    context.abort(code, message)


def unary(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(self, request, context):
        try:
            return fn(self, request, context)
        except Exception as exc:  # noqa: BLE001 - mapped, never leaked as UNKNOWN
            if isinstance(exc, grpc.RpcError) or context.code() is not None:
                raise  # already aborted
            failure = exc
        _abort(context, failure)
    return wrapper


def streaming(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(self, request, context) -> Iterator:
        try:
            yield from fn(self, request, context)
            return
        except Exception as exc:  # noqa: BLE001
            if isinstance(exc, grpc.RpcError) or context.code() is not None:
                raise
            failure = exc
        _abort(context, failure)
    return wrapper
