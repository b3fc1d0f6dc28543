"""The one lifecycle every service implements: setup → serve → drain → close.

`serve_service` drives it: `setup` builds what the service works with and says what API it
serves; the gRPC server (health, reflection, token, TLS), /metrics and the supervised loops are
started here, in one place; on a stop or a loop's death health turns NOT_SERVING, `drain` finishes
the work in flight (the API still answers), and `close` releases what `setup` took, always, even
after a failed setup. Details: docs/internals/services.md
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field

from shared.runtime.service_main import grpc_service, run_loops


@dataclass(frozen=True)
class Listen:
    """Where a service listens: its gRPC API and its /metrics (None: it serves them elsewhere)."""

    host: str
    port: int
    max_message_bytes: int
    metrics_port: int | None
    run_id: str = ""


@dataclass(frozen=True)
class Api:
    """What `setup` hands the lifecycle: the servicers to register (`(add_to_server, servicer)`),
    the gRPC service names health reports, and the fields the start line logs."""

    register: Sequence
    names: Sequence[str]
    fields: dict[str, object] = field(default_factory=dict)


class ServiceLifecycle(abc.ABC):
    """A service: `setup` (None: this process serves no API, e.g. a trainer rank that follows
    rank 0, and its work is done), `loops` (run until the stop; the ones in `finishing` may end
    the service by returning), `drain` and `close`."""

    name: str
    finishing: frozenset[str] = frozenset()

    @abc.abstractmethod
    def listen(self) -> Listen: ...

    @abc.abstractmethod
    async def setup(self) -> Api | None: ...

    @abc.abstractmethod
    def loops(self, stop: asyncio.Event) -> dict[str, Coroutine]: ...

    async def drain(self) -> None:  # noqa: B027 - most services have nothing in flight to finish
        """Finish the work in flight once the loops stopped (health already NOT_SERVING)."""

    async def close(self) -> None:  # noqa: B027 - a service that holds nothing releases nothing
        """Release what `setup` took (it may have stopped halfway)."""


async def serve_service(
    service: ServiceLifecycle, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None
) -> None:
    """Run `service` through its lifecycle until `stop` is set or a loop dies (`LoopDied`)."""
    stop = stop or asyncio.Event()
    try:
        api = await service.setup()
        if api is None:
            return
        at = service.listen()
        async with grpc_service(
            service.name,
            api.register,
            api.names,
            at.host,
            at.port,
            at.max_message_bytes,
            at.metrics_port,
            ready,
            run=at.run_id,
            **api.fields,
        ) as serving:
            try:
                await run_loops(service.loops(stop), stop, serving.health, finishing=service.finishing)
            finally:
                await service.drain()
    finally:
        await service.close()
