"""The settling stage: a written checkpoint put in place (`LATEST`) and its rollouts acknowledged. It needs no
model (it writes from the save's own copy of the state), so it runs beside a step; `Acknowledgements.lock` keeps one
save, settle or acknowledgement at a time."""

from __future__ import annotations

import asyncio
import contextlib

import redis.exceptions

from services.trainer.acknowledgements import Acknowledgements


class Settling:
    def __init__(self, acks: Acknowledgements) -> None:
        self.acks = acks
        self.task: asyncio.Task | None = None  # a checkpoint being put in place, its rollouts acknowledged

    def tend(self) -> None:
        """The landing that ended forgotten (its error raised); a checkpoint whose shards are written, landed."""
        if self.task is not None and self.task.done():
            ended, self.task = self.task, None
            ended.result()
        if self.task is None and self.acks.save_done():
            self.task = asyncio.ensure_future(self.acks.settle(wait=False))

    async def acknowledge(self) -> None:
        """An acknowledgement cut off (Redis restarting or frozen), made again."""
        if self.acks.saved and self.task is None:
            await self.acks.acknowledge()

    async def land(self) -> None:
        """The checkpoint under way waited for, put in place and its rollouts acknowledged."""
        if self.acks.saving is not None:
            await self.acks.settle(wait=True)

    async def finish(self) -> None:
        """A stop: the landing under way and the checkpoint under way (it is on disk soon) in place; with Redis
        unreachable their rollouts stay pending, for the next start."""
        if self.task is not None:
            with contextlib.suppress(redis.exceptions.RedisError):
                await self.task
            self.task = None
        with contextlib.suppress(redis.exceptions.RedisError):
            await self.land()

    async def close(self) -> None:
        """A run that ended by an error: its checkpoint's landing seen to."""
        if self.task is not None:
            with contextlib.suppress(Exception):
                await self.task
