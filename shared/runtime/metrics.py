"""The Prometheus /metrics endpoint of a service process: one per process, started before the
model loads (so a cold start is a target that answers, `steadyrl_service_loading` = 1, not one
that is down), every sample labelled with the run it serves (two runs in one Prometheus stay apart)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from prometheus_client import REGISTRY, CollectorRegistry, Gauge, start_http_server
from prometheus_client.metrics_core import Metric

LOADING = Gauge(
    "steadyrl_service_loading",
    "1 while the service loads its model and is not serving yet, else 0",
    ["service", "pool"],
)

_server: tuple[int, str] | None = None  # (bound port, run) of this process's endpoint


class RunLabelled:
    """The default registry's samples, each with a `run` label added (a collector)."""

    def __init__(self, run: str) -> None:
        self.run = run

    def collect(self) -> Iterator[Metric]:
        for metric in REGISTRY.collect():
            labelled = Metric(metric.name, metric.documentation, metric.type, metric.unit)
            labelled.samples = [s._replace(labels={**s.labels, "run": self.run}) for s in metric.samples]
            yield labelled


def registry_of(run: str) -> CollectorRegistry:
    """The default registry, with `run` on every sample when given."""
    if not run:
        return REGISTRY
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RunLabelled(run))
    return registry


def start_metrics_server(port: int, host: str = "127.0.0.1", run: str = "") -> int:
    """Serve the default registry on host:port (0 = a free port), with `run` on every sample when
    given; once per process (a second call returns the bound port). Returns the bound port."""
    global _server
    if _server is not None:
        return _server[0]
    server, _thread = start_http_server(port, addr=host, registry=registry_of(run))
    _server = (server.server_port, run)
    return _server[0]


@contextlib.contextmanager
def loading(service: str, metrics_port: int | None, host: str, run: str = "", pool: str = "") -> Iterator[None]:
    """/metrics up (on a torchrun rank, rank 0's only) and `steadyrl_service_loading` 1 while the
    block loads the model; 0 after, whether it loaded or failed."""
    if metrics_port is not None and os.environ.get("RANK", "0") == "0":
        start_metrics_server(metrics_port, host, run)
    gauge = LOADING.labels(service, pool)
    gauge.set(1)
    try:
        yield
    finally:
        gauge.set(0)
