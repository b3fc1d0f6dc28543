"""Trainer process: the Trainer gRPC API (Status, Checkpoint, Pause, Resume) around the loop, on the service
lifecycle (shared/runtime/service_lifecycle.py)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine

from redis.asyncio import Redis

from services.trainer.config import TrainerSettings
from services.trainer.loop import Trainer
from shared.rpc.steadyrl.v1 import common_pb2, trainer_pb2_grpc
from shared.rpc.steadyrl.v1 import trainer_pb2 as pb
from shared.runtime.metrics import loading
from shared.runtime.service_lifecycle import Api, Listen, ServiceLifecycle, serve_service
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


class TrainerService(ServiceLifecycle):
    """Rank 0 serves the Trainer API and runs the loop until a stop or `max_steps`; with data parallel, a rank > 0
    follows rank 0's commands and serves nothing (only rank 0 reads Redis, serves gRPC and publishes)."""

    name = "trainer"
    finishing = frozenset({"trainer"})  # the loop returns at max_steps: the run is done

    def __init__(self, settings: TrainerSettings) -> None:
        self.settings = settings
        self.redis: Redis | None = None
        self.trainer: Trainer | None = None

    def listen(self) -> Listen:
        s = self.settings
        return Listen(s.host, s.port, s.max_message_bytes, s.metrics_port, s.run_id)

    async def setup(self) -> Api | None:
        s = self.settings
        bind_default_executor(s.compute.torch_threads)
        self.redis = s.redis()
        with loading("trainer", s.metrics_port, s.host, s.run_id):
            self.trainer = trainer = await asyncio.to_thread(Trainer, s, self.redis)
        if trainer.runner.rank > 0:
            steps = await asyncio.to_thread(trainer.runner.follow)
            log.info("event=follower_done rank=%d steps=%d", trainer.runner.rank, steps)
            return None
        return Api(
            [(trainer_pb2_grpc.add_TrainerServicer_to_server, TrainerServicer(trainer))],
            ["steadyrl.v1.Trainer"],
            {"step": trainer.state.step, "version": trainer.state.version},
        )

    def loops(self, stop: asyncio.Event) -> dict[str, Coroutine]:
        return {"trainer": self.trainer.run(stop)}

    async def drain(self) -> None:
        if self.trainer.acks.unsaved:  # a clean stop keeps every trained step: checkpoint, then acknowledge
            await self.trainer.checkpoint_now()

    async def close(self) -> None:
        if self.trainer is not None and self.trainer.runner.rank == 0:  # a follower has nothing to stop or close
            await asyncio.to_thread(self.trainer.runner.stop_followers)
            await self.trainer.close()
        if self.redis is not None:
            await self.redis.aclose()


async def serve(
    settings: TrainerSettings, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None
) -> None:
    await serve_service(TrainerService(settings), ready, stop)
