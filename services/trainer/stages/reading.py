"""The reading stage: the rollout stream into the group buffer, one read in flight (beside a step), and the Redis
server watched: a restarted one may have lost acknowledged writes, a Redis error replies."""

from __future__ import annotations

import asyncio
import logging
import time

from services.trainer.acknowledgements import Acknowledgements
from services.trainer.config import TrainerSettings
from services.trainer.groups import GroupBuffer
from services.trainer.intake import Intake
from services.trainer.stream import RedisRolloutSource

log = logging.getLogger("steadyrl.trainer")


class Reading:
    def __init__(
        self,
        settings: TrainerSettings,
        source: RedisRolloutSource,
        intake: Intake,
        buffer: GroupBuffer,
        acks: Acknowledgements,
    ) -> None:
        self.settings = settings
        self.source = source
        self.intake = intake
        self.buffer = buffer
        self.acks = acks
        self.task: asyncio.Future | None = None  # the read in flight
        self.redis_id = ""  # the Redis server read from (`identity`)
        self.checked = 0.0  # when its identity was last asked
        self.resync = False  # a Redis error: replies may be lost, entries delivered but never seen

    async def start(self) -> int:
        """Join the consumer group and take back what a previous trainer left pending (how many)."""
        await self.source.open()
        self.buffer.dead_groups |= await self.source.dead_groups()
        claimed = await self.intake.claim_all()
        self.redis_id = await self.source.identity()
        return claimed

    async def keep_in_sync(self) -> None:
        """A restarted Redis reconciled with what was trained and not acknowledged (once a second); what a
        Redis error may have delivered unseen claimed back."""
        if time.monotonic() - self.checked >= 1.0:
            self.checked = time.monotonic()
            identity = await self.source.identity()
            if identity != self.redis_id:  # Redis restarted: it may have lost acknowledged writes
                await self.intake.reconcile({rid for _, rid in self.acks.pending()})
                self.redis_id = identity
                self.resync = False
        if self.resync:
            log.info("event=resynced claimed=%d", await self.intake.claim_all())
            self.resync = False

    def next(self) -> asyncio.Future:
        """The read in flight (one started if none is)."""
        if self.task is None:
            self.task = asyncio.ensure_future(self.source.read(self.settings.stream.read_block_ms))
        return self.task

    async def take(self) -> None:
        """A finished read's entries judged into the buffer, then stale groups dropped and, with dynamic
        sampling, groups of equal rewards filtered."""
        if self.task is None or not self.task.done():
            return
        done, self.task = self.task, None
        await self.intake.take(done.result())
        await self.intake.drop_stale(self.settings.max_staleness)
        if self.settings.filter_cap:
            await self.intake.filter_equal(self.settings.filter_cap)

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()  # what it read stays pending in the group: claimed on the next start
            await asyncio.gather(self.task, return_exceptions=True)
            self.task = None
