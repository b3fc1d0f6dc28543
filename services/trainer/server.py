"""Trainer process: the Trainer gRPC API (Status, Checkpoint, Pause, Resume) around the loop."""

from __future__ import annotations

import asyncio
import logging

from services.trainer.config import TrainerSettings
from services.trainer.loop import Trainer
from shared.rpc.steadyrl.v1 import common_pb2, trainer_pb2_grpc
from shared.rpc.steadyrl.v1 import trainer_pb2 as pb
from shared.runtime.metrics import loading
from shared.runtime.service_main import grpc_service, run_loops
from shared.runtime.torch_threads import bind_default_executor

log = logging.getLogger("steadyrl.trainer")


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def _status(self) -> pb.TrainerStatus:
        t = self.trainer
        step, version, trained = t.reported
        return pb.TrainerStatus(
            version=common_pb2.PolicyVersion(version=version, parent_version=max(version - 1, 0)),
            step=step,
            paused=t.paused,
            recipe=t.runner.recipe,
            rollouts_trained=trained,
            rollouts_dropped_stale=t.state.counters.get("dropped_stale", 0),
            rollouts_dead_lettered=t.state.counters.get("dead_lettered", 0),
            last_metrics={k: float(v) for k, v in t.last_metrics.items()},
        )

    async def Status(self, request, context):
        return self._status()

    async def Checkpoint(self, request, context):
        path = await self.trainer.checkpoint_now()
        return pb.CheckpointReply(path=str(path), step=self.trainer.state.step, version=self.trainer.state.version)

    async def Pause(self, request, context):
        self.trainer.paused = True
        return self._status()

    async def Resume(self, request, context):
        self.trainer.paused = False
        return self._status()


async def serve(
    settings: TrainerSettings, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None
) -> None:
    stop = stop or asyncio.Event()
    bind_default_executor(settings.compute.torch_threads)
    redis = settings.redis()
    with loading("trainer", settings.metrics_port, settings.host, settings.run_id):
        trainer = await asyncio.to_thread(Trainer, settings, redis)
    if trainer.runner.rank > 0:  # data parallel: only rank 0 reads Redis, serves gRPC and publishes
        steps = await asyncio.to_thread(trainer.runner.follow)
        log.info("event=follower_done rank=%d steps=%d", trainer.runner.rank, steps)
        await redis.aclose()
        return
    try:
        async with grpc_service(
            "trainer",
            [(trainer_pb2_grpc.add_TrainerServicer_to_server, TrainerServicer(trainer))],
            ["steadyrl.v1.Trainer"],
            settings.host,
            settings.port,
            settings.max_message_bytes,
            settings.metrics_port,
            ready,
            run=settings.run_id,
            step=trainer.state.step,
            version=trainer.state.version,
        ) as serving:
            await run_loops({"trainer": trainer.run(stop)}, stop, serving.health, finishing=frozenset({"trainer"}))
    finally:
        if trainer.acks.unsaved:  # a clean stop keeps every trained step: checkpoint, then acknowledge
            await trainer.checkpoint_now()
        await asyncio.to_thread(trainer.runner.stop_followers)
        await trainer.close()
        await redis.aclose()
