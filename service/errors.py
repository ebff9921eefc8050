"""The one place where exceptions become gRPC status codes (never UNKNOWN).

Servicer methods raise domain errors (ctxcache/errors.py, or the store's / decoder's own) and
are wrapped by `rpc.unary` / `rpc.streaming` (grpc.aio), which abort the call with the mapped
code and a message cut to a bounded length.
"""

from __future__ import annotations

import logging

import grpc
import torch

from ctxcache.errors import ServiceError, public_text

log = logging.getLogger("ctxcache.service")


def _foreign_codes() -> dict[type, grpc.StatusCode]:
    """Errors of other components, imported lazily so this module stays cheap to import."""
    from ctxcache.decoder import ArtifactMismatch
    from ctxcache import store

    codes: dict[type, grpc.StatusCode] = {ArtifactMismatch: grpc.StatusCode.FAILED_PRECONDITION}
    for name, code in (("CorruptArtifact", grpc.StatusCode.DATA_LOSS),
                       ("StoreDamaged", grpc.StatusCode.DATA_LOSS),
                       ("StoreFull", grpc.StatusCode.RESOURCE_EXHAUSTED),
                       ("RegistryUnavailable", grpc.StatusCode.UNAVAILABLE),
                       ("StoreUnavailable", grpc.StatusCode.UNAVAILABLE),
                       ("StoreDeadline", grpc.StatusCode.DEADLINE_EXCEEDED),
                       ("FormatMismatch", grpc.StatusCode.FAILED_PRECONDITION),
                       ("NotFound", grpc.StatusCode.NOT_FOUND)):
        try:
            cls = getattr(store, name)
        except (AttributeError, ImportError):
            continue
        if isinstance(cls, type):
            codes[cls] = code
    return codes


def _log_device_memory(exc: BaseException) -> None:
    """One line an operator can size from: what torch holds and what the driver has left."""
    if not torch.cuda.is_available():
        log.warning("out of GPU memory: %s", str(exc).splitlines()[0][:120])
        return
    free, total = torch.cuda.mem_get_info()
    log.warning("out of GPU memory (%s): torch allocated %.2f GiB, reserved %.2f GiB; driver free %.2f of "
                "%.2f GiB", str(exc).splitlines()[0][:120], torch.cuda.memory_allocated() / 2**30,
                torch.cuda.memory_reserved() / 2**30, free / 2**30, total / 2**30, exc_info=exc)


def status_for(exc: BaseException, admin: bool = False) -> tuple[grpc.StatusCode, str]:
    """(code, message); `admin` callers read the whole message, others `public_text`, and the
    server log keeps what a tenant was not told."""
    if isinstance(exc, ServiceError):
        return grpc.StatusCode[exc.code], _told(exc, str(exc), admin)
    for cls, code in _foreign_codes().items():
        if isinstance(exc, cls):
            return code, _told(exc, f"{type(exc).__name__}: {exc}", admin)
    if isinstance(exc, MemoryError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, "out of memory"
    if isinstance(exc, torch.OutOfMemoryError):  # a context or build that does not fit on the GPU
        _log_device_memory(exc)
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"out of GPU memory: {str(exc).split('. ')[0]}"
    if isinstance(exc, (torch.AcceleratorError, RuntimeError)) and ("out of memory" in str(exc)
                                                                   or "ALLOC_FAILED" in str(exc)):
        # the driver's own allocations (a kernel module, a cuBLAS handle, a graph) find HBM full
        _log_device_memory(exc)
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"out of GPU memory: {str(exc).splitlines()[0]}"
    log.exception("internal error", exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


def _told(exc: BaseException, full: str, admin: bool) -> str:
    if admin:
        return full
    public = public_text(exc)
    if public != full:
        log.warning("%s (the caller was told: %s)", full, public)
    return public
