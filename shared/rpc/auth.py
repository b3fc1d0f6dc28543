"""One bearer token on every gRPC method but health (which probes call without one); reflection,
which lists the services and their methods, wants the token too.

Servers: `start_server(..., token=...)` adds `TokenAuthInterceptor`, which refuses a call without
`authorization: Bearer <token>` with UNAUTHENTICATED and counts it. Clients: `channel(address)`
attaches the token to every call. The token comes from STEADYRL_TOKEN_FILE (preferred) or
STEADYRL_TOKEN, shared by every service of a deployment, and is never logged.
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path

import grpc
from prometheus_client import Counter

OPEN_PREFIXES = ("/grpc.health.v1.Health/",)
REFUSED = Counter("steadyrl_rpc_auth_refused_total", "gRPC calls refused for a missing or wrong token", ["service"])
MESSAGE = "missing or wrong bearer token"


def token_from_env() -> str | None:
    """The deployment's token; deploy/env.example's placeholder is refused (PlaceholderSecret)."""
    from shared.rpc.secret_files import PlaceholderSecret, read_secret, refuse_empty, refuse_placeholder

    if "STEADYRL_TOKEN_FILE" in os.environ:  # set, even empty: a file is meant (empty names none: refused)
        path = os.environ["STEADYRL_TOKEN_FILE"]
        if not path.strip():
            raise PlaceholderSecret("STEADYRL_TOKEN_FILE is set but empty: name the token's file, or unset it")
        return read_secret(Path(path), "the deployment's token, STEADYRL_TOKEN_FILE")
    if "STEADYRL_TOKEN" in os.environ:  # set, even empty: an empty token would turn the check off
        what = "the deployment's token, STEADYRL_TOKEN"
        return refuse_placeholder(refuse_empty(os.environ["STEADYRL_TOKEN"].strip(), what), what)
    return None


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str) -> None:
        self.expected = f"Bearer {token}".encode()

    def _allowed(self, details: grpc.HandlerCallDetails) -> bool:
        if details.method.startswith(OPEN_PREFIXES):
            return True
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else value
                return hmac.compare_digest(given, self.expected)
        return False

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or self._allowed(details):
            return handler
        REFUSED.labels(details.method.split("/")[1] if details.method.count("/") >= 2 else "?").inc()

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, MESSAGE)

        async def deny_stream(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, MESSAGE)
            yield  # pragma: no cover - abort raises

        if handler.unary_unary:
            return handler._replace(unary_unary=deny)
        if handler.unary_stream:
            return handler._replace(unary_stream=deny_stream)
        if handler.stream_unary:
            return handler._replace(stream_unary=deny)
        return handler._replace(stream_stream=deny_stream)


class _Metadata:
    def __init__(self, token: str) -> None:
        self.pair = ("authorization", f"Bearer {token}")

    def _details(self, details):
        metadata = list(details.metadata or []) + [self.pair]
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )


class _UnaryUnary(_Metadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _UnaryStream(_Metadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _StreamUnary(_Metadata, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


class _StreamStream(_Metadata, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


def channel(address: str, options=None, token: str | None = None) -> grpc.aio.Channel:
    """A grpc.aio channel whose every call carries the deployment's bearer token (when one is set),
    over TLS when the deployment uses it."""
    from shared.rpc.tls import aio_channel

    token = token if token is not None else token_from_env()
    interceptors = [cls(token) for cls in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)] if token else None
    return aio_channel(address, options=options, interceptors=interceptors)
