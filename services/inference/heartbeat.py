"""A replica's heartbeat: its version and idle time to the orchestrator every second, and as soon
as it serves a new version (best effort: the orchestrator's status and the replicas' idle share
lag by up to a second, nothing else depends on it)."""

from __future__ import annotations

import asyncio
import contextlib

import grpc

from services.inference.config import InferenceSettings
from services.inference.worker import RolloutWorker
from shared.engines import Engine


async def heartbeat(settings: InferenceSettings, engine: Engine, worker: RolloutWorker, stop: asyncio.Event) -> None:
    """Report this replica's version to the orchestrator every second, and as soon as it serves a
    new one (best effort)."""
    from shared.rpc import channel_options
    from shared.rpc.auth import channel as auth_channel
    from shared.rpc.steadyrl.v1 import orchestrator_pb2, orchestrator_pb2_grpc

    async with auth_channel(settings.orchestrator_address, options=channel_options()) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        while not stop.is_set():
            with contextlib.suppress(grpc.aio.AioRpcError):
                await stub.Heartbeat(
                    orchestrator_pb2.ReplicaHeartbeat(
                        replica_id=settings.replica_id,
                        service="inference",
                        policy_version=engine.version,
                        address=f"{settings.host}:{settings.port}",
                        tokens_per_second=worker.tokens_per_second,
                        **idle_time(settings, worker),
                    ),
                    timeout=2,
                )
            reported = engine.version
            for _ in range(10):  # a second, or less once a new version is served
                await asyncio.sleep(0.1)
                if engine.version != reported:
                    break


def idle_time(settings: InferenceSettings, worker: RolloutWorker) -> dict[str, float]:
    """A rollout replica's idle and uptime seconds (a policy_eval replica's waits between rounds are
    not the run's pace: it reports none)."""
    if settings.pool != "rollouts":
        return {}
    return {"idle_seconds": worker.idle.idle_seconds, "uptime_seconds": worker.idle.uptime_seconds}
