"""One error shape for the whole HTTP front, OpenAI's: {"error": {message, type, param, code}},
with the HTTP status of the gRPC status the same failure gets there (service/errors.py decides
that once for both fronts)."""

from __future__ import annotations

import json
from typing import Any

import grpc
from starlette.responses import JSONResponse

from ctxcache.errors import InvalidArgument

from ctxcache.service.errors import status_for
from ctxcache.service.http.models import ModelNotFound
from ctxcache.service.rpc.calls import cut

S = grpc.StatusCode
# gRPC status -> (HTTP status, OpenAI error type)
_HTTP = {
    S.INVALID_ARGUMENT: (400, "invalid_request_error"),
    S.OUT_OF_RANGE: (400, "invalid_request_error"),
    S.UNAUTHENTICATED: (401, "authentication_error"),
    S.PERMISSION_DENIED: (403, "permission_error"),
    S.NOT_FOUND: (404, "not_found_error"),
    S.ALREADY_EXISTS: (409, "conflict_error"),
    S.FAILED_PRECONDITION: (409, "conflict_error"),  # e.g. a context still BUILDING
    S.ABORTED: (409, "conflict_error"),
    S.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),  # streams or build queue full: retry later
    S.CANCELLED: (499, "cancelled"),
    S.UNIMPLEMENTED: (501, "not_implemented_error"),
    S.UNAVAILABLE: (503, "service_unavailable_error"),
    S.DEADLINE_EXCEEDED: (504, "timeout_error"),
    S.DATA_LOSS: (500, "server_error"),  # a stored artifact failed its checksum
    S.INTERNAL: (500, "server_error"),
    S.UNKNOWN: (500, "server_error"),
}
# statuses with no gRPC twin (HTTP's own), for errors raised by the framework
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large", 415: "invalid_request_error",
          503: "service_unavailable_error"}
# convert.py names the proto's fields; the HTTP bodies name them as OpenAI does
_PARAMS = {"sampling.temperature": "temperature", "sampling.top_p": "top_p", "sampling.max_tokens": "max_tokens",
           "question": "prompt", "chat.messages": "messages", "chat": "messages", "documents.documents": "documents",
           "kv_codec": "codec", "ttl_seconds": "ttl"}


class ErrorResponse(JSONResponse):
    """ASCII JSON: an error may quote what the client sent, lone surrogates included, and
    Starlette's UTF-8 rendering would fail on those with a 500."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode()


def envelope(status: int, message: str, type_: str | None = None, param: str | None = None,
             code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": cut(message), "type": type_ or _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def error_body(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """Any exception -> (HTTP status, envelope); unexpected ones are logged there (status_for)."""
    code, message = status_for(exc)
    status, type_ = _HTTP.get(code, (500, "server_error"))
    param = None
    if isinstance(exc, ModelNotFound):
        return status, envelope(status, message, "invalid_request_error", "model", "model_not_found")
    if isinstance(exc, InvalidArgument):
        param = _param(exc.field)
        message = message.replace(exc.field, param, 1)
    return status, envelope(status, message, type_, param, code.name.lower())


def _param(field: str) -> str:
    for proto, http in _PARAMS.items():
        if field == proto or field.startswith(proto + ".") or field.startswith(proto + "["):
            return http + field[len(proto):]
    return field


def error_response(exc: BaseException, headers: dict[str, str] | None = None) -> ErrorResponse:
    status, body = error_body(exc)
    if status == 401:
        headers = {**(headers or {}), "WWW-Authenticate": "Bearer"}
    return ErrorResponse(body, status, headers=headers)


def validation_response(errors: list[dict[str, Any]], body: Any = None) -> ErrorResponse:
    """FastAPI's 422 (and pydantic's errors) as a 400 naming the first bad field; a body that is
    not JSON names no field and says where it broke (FastAPI's loc is a character offset)."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    if first.get("type") == "json_invalid":
        return ErrorResponse(envelope(400, _json_error(first, body), code="invalid_json"), 400)
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    message = f"{param or 'body'}: {first.get('msg')}"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return ErrorResponse(envelope(400, message + more, param=param, code="invalid_argument"), 400)


def _json_error(error: dict[str, Any], body: Any) -> str:
    loc = error.get("loc", ())
    pos = loc[-1] if loc and isinstance(loc[-1], int) else None
    why = (error.get("ctx") or {}).get("error", "invalid JSON")
    if pos is None or not isinstance(body, (str, bytes)):
        return f"the request body is not valid JSON: {why}"
    text = body.decode(errors="replace") if isinstance(body, bytes) else body
    line = text.count("\n", 0, pos) + 1
    column = pos - (text.rfind("\n", 0, pos) + 1) + 1
    return f"the request body is not valid JSON: {why} at line {line}, column {column} (character {pos + 1})"


def http_response(status: int, detail: Any, headers: dict[str, str] | None = None) -> ErrorResponse:
    """Starlette's own HTTPException (unknown route, wrong method, unparsable body)."""
    code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(status)
    return ErrorResponse(envelope(status, str(detail), code=code), status, headers=headers)
