"""Who is calling: bearer tokens bound to tenants, and a separate admin credential.

Tokens are compared in constant time. A tenant token sees only its tenant's contexts (lists
are filtered, reads of another tenant's id answer NOT_FOUND, as if absent) and cannot call
AdminService or reflection; the admin token can, and sees every tenant. With no token at all
the server is open (one trust domain) and the CLI keeps it on loopback.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import grpc


@dataclass(frozen=True)
class Caller:
    tenant: str | None  # None: every tenant (admin, or an open server)
    admin: bool

    def sees(self, tenant: str) -> bool:
        return self.tenant is None or self.tenant == tenant


OPEN = Caller(None, True)


class Auth:
    def __init__(self, tenant_tokens: Mapping[str, str], admin_token: str | None) -> None:
        """tenant_tokens: token -> tenant; admin_token: the operator's credential."""
        self._tenants = [(f"Bearer {t}".encode(), tenant) for t, tenant in tenant_tokens.items()]
        self._admin = f"Bearer {admin_token}".encode() if admin_token else None

    @property
    def enabled(self) -> bool:
        return bool(self._tenants) or self._admin is not None

    def caller(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> Caller | None:
        """The authenticated caller, or None (missing or wrong token)."""
        if not self.enabled:
            return OPEN
        given = b""
        for key, value in metadata or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else value
        found = None
        if self._admin is not None and hmac.compare_digest(given, self._admin):
            found = OPEN
        for expected, tenant in self._tenants:  # every token compared: no early exit to time
            if hmac.compare_digest(given, expected):
                found = found or Caller(tenant, False)
        return found


def _deny(code: grpc.StatusCode, message: str, like: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `like` (None: unary) that only aborts."""
    async def unary(request, context):
        await context.abort(code, message)

    async def stream(request, context):
        await context.abort(code, message)
        yield  # pragma: no cover - makes this an async generator

    req_stream = like is not None and like.request_streaming
    resp_stream = like is not None and like.response_streaming
    make = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    fn = stream if resp_stream else unary
    kw = {} if like is None else {"request_deserializer": like.request_deserializer,
                                  "response_serializer": like.response_serializer}
    return make[(req_stream, resp_stream)](fn, **kw)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Authentication before anything else (unknown methods included); AdminService and
    reflection need the admin credential. Health checks stay open (load balancers)."""

    def __init__(self, auth: Auth, admin_prefixes: tuple[str, ...]) -> None:
        self.auth, self.admin_prefixes = auth, admin_prefixes

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if details.method.startswith("/grpc.health.v1.Health/"):
            return handler
        caller = self.auth.caller(details.invocation_metadata)
        if caller is None:
            return _deny(grpc.StatusCode.UNAUTHENTICATED, "authorization: missing or wrong bearer token", handler)
        if not caller.admin and details.method.startswith(self.admin_prefixes):
            return _deny(grpc.StatusCode.PERMISSION_DENIED, "this method needs the admin credential", handler)
        return handler
