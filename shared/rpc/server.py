"""Start a grpc.aio server with the standard health and reflection services."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

# Chunks are 1 MiB by default; 8 MiB leaves room for manifests of very large models while
# keeping one message far below what a misbehaving peer could use to exhaust memory.
DEFAULT_MAX_MESSAGE_BYTES = 8 * 1024 * 1024


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.keepalive_permit_without_calls", 1),
        # a peer that restarts (or starts after us) is found again within 2 s, not minutes
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2000),
    ]


async def start_server(
    register: Sequence[tuple[Callable[[object, grpc.aio.Server], None], object]],
    service_names: Sequence[str],
    address: str,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    token: str | None = None,
) -> tuple[grpc.aio.Server, int, health.HealthServicer]:
    """Serve the given servicers plus health (all SERVING) and reflection; returns the bound port.

    With a bearer token (the argument, else STEADYRL_TOKEN_FILE / STEADYRL_TOKEN) every method but
    health and reflection requires it. TLS / mTLS when STEADYRL_TLS_* say so (shared.rpc.tls)."""
    from shared.rpc.auth import TokenAuthInterceptor, token_from_env
    from shared.rpc.tls import bind, tls_from_env

    token = token if token is not None else token_from_env()
    interceptors = [TokenAuthInterceptor(token)] if token else None
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[
            *channel_options(max_message_bytes),
            # accept the clients' keepalive pings (every 20 s) instead of answering GOAWAY too_many_pings
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
            ("grpc.http2.max_ping_strikes", 0),
            # no SO_REUSEPORT: a second server on a taken port must fail, not silently share its calls
            ("grpc.so_reuseport", 0),
        ],
    )
    for add, servicer in register:
        add(servicer, server)
    health_servicer = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    port = bind(server, address, tls_from_env())
    if port == 0:
        raise OSError(f"cannot bind gRPC server to {address}")
    await server.start()
    for name in ["", *service_names]:
        result = health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        if hasattr(result, "__await__"):
            await result
    return server, port, health_servicer
