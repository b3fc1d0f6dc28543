"""Prometheus /metrics endpoint for a service process."""

from __future__ import annotations

from prometheus_client import start_http_server


def start_metrics_server(port: int, host: str = "127.0.0.1") -> int:
    """Serve the default registry on host:port (0 = a free port); returns the bound port."""
    server, _thread = start_http_server(port, addr=host)
    return server.server_port
