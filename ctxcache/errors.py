"""The service's domain errors, raised by the rooms that serve a request (the indexer's
admission and builds, the decoder's streams) and by the fronts.

Each names its status (`code`, a gRPC status name); the fronts translate it in one place
(service/errors.py: gRPC codes, and through them HTTP statuses), so nothing below the service
imports gRPC.
"""

from __future__ import annotations


class ServiceError(Exception):
    """`detail` (the cause: an address, a URI) joins the message for admin callers and the
    server log; `public`, what a tenant reads, is the message alone."""

    code = "INTERNAL"

    def __init__(self, message: str = "", *, detail: object = None) -> None:
        super().__init__(message if detail is None else f"{message}: {detail}")
        self.public = message


class InvalidArgument(ServiceError):
    code = "INVALID_ARGUMENT"

    def __init__(self, field: str, why: str) -> None:
        super().__init__(f"{field}: {why}")
        self.field = field


class NotFound(ServiceError):
    code = "NOT_FOUND"


class FailedPrecondition(ServiceError):
    code = "FAILED_PRECONDITION"


class ResourceExhausted(ServiceError):
    code = "RESOURCE_EXHAUSTED"


class Unavailable(ServiceError):
    code = "UNAVAILABLE"


class DataLoss(ServiceError):
    code = "DATA_LOSS"


class DeadlineExceeded(ServiceError):
    code = "DEADLINE_EXCEEDED"


class Unauthenticated(ServiceError):
    code = "UNAUTHENTICATED"


class PermissionDenied(ServiceError):
    code = "PERMISSION_DENIED"


class Cancelled(ServiceError):
    code = "CANCELLED"


def public_text(exc: BaseException) -> str:
    """What a tenant may read of exc: the failing part ("object store unavailable", "registry
    unavailable") without the address the full message names."""
    return exc.public if isinstance(exc, ServiceError) else failure_text(exc)


def failure_text(exc: BaseException) -> str:
    """A failed build's error as its tenant reads it (GetContext): the type and public text."""
    public = getattr(exc, "public", None)
    return f"{type(exc).__name__}: {public if isinstance(public, str) else exc}"
