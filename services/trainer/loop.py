"""The trainer's loop: rollout stream → complete groups → one global step → checkpoint → publish.

Four stages (services/trainer/stages/), each owning its task in flight and its timestamps: reading, stepping
(under the model lock), settling (a checkpoint put in place, its rollouts acknowledged) and publishing. What may
run beside what is decided in `Trainer.tend` alone: beside a step the stream is read, a written checkpoint lands
and the last version is announced; a publish retried, weight-sync's held check and an acknowledgement cut off wait
for the step's end. A rollout is acknowledged only once a checkpoint holding it is `LATEST`.

Details: docs/internals/trainer.md"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import redis.exceptions
from redis.asyncio import Redis

from services.trainer.acknowledgements import Acknowledgements
from services.trainer.config import TrainerSettings
from services.trainer.groups import GroupBuffer
from services.trainer.intake import Intake
from services.trainer.model_runner import StepRunner
from services.trainer.replica_idle import ReplicaIdle
from services.trainer.stages.publishing import Publishing
from services.trainer.stages.reading import Reading
from services.trainer.stages.settling import Settling
from services.trainer.stages.stepping import Stepping
from services.trainer.step_log import StepLog
from services.trainer.stream import RedisRolloutSource
from services.trainer.version_publisher import VersionPublisher
from shared.runstore.keys import RunKeys

log = logging.getLogger("steadyrl.trainer")


class Trainer:
    def __init__(self, settings: TrainerSettings, redis: Redis) -> None:
        self.settings = s = settings
        self.runner = StepRunner(settings)
        self.state = self.runner.restore()
        self.source = RedisRolloutSource(redis, s.run_id, s.consumer, s.stream.dead_letter_maxlen)
        self.buffer = GroupBuffer(
            s.group_size,
            s.run_id,
            self.runner.limits,
            require_teacher=s.distill.enabled,
            teacher_top_k=s.distill.top_k if s.distill.enabled else 0,
        )
        self.intake = Intake(self.source, self.buffer, self.state)
        self.publisher = VersionPublisher(settings, redis)
        self.acks = Acknowledgements(self.runner, self.source)  # trained, checkpointed, acknowledged
        self.paused = False
        self.steplog = StepLog(settings)
        if self.runner.rank == 0:  # the rank that writes the lines (the others follow its commands)
            self.steplog.resume(self.state.step)
        self.model_lock = asyncio.Lock()  # one of: a step (train, checkpoint, publish), a Checkpoint request
        self.reading = Reading(s, self.source, self.intake, self.buffer, self.acks)
        self.settling = Settling(self.acks)
        self.publishing = Publishing(self.publisher, self.runner, self.state, self.model_lock)
        self.stepping = Stepping(
            s,
            runner=self.runner,
            state=self.state,
            buffer=self.buffer,
            intake=self.intake,
            acks=self.acks,
            steplog=self.steplog,
            replica_idle=ReplicaIdle(redis, RunKeys(s.run_id).replica_idle),
            settling=self.settling,
            publishing=self.publishing,
            model_lock=self.model_lock,
        )
        self.waiting_logged = time.monotonic()  # the last `waiting_for_rollouts` line

    @property
    def done(self) -> bool:
        return self.stepping.done

    @property
    def reported(self) -> tuple[int, int, int]:
        """(step, version, rollouts trained) as of the last version out (what Status says)."""
        return self.publishing.reported

    @property
    def last_metrics(self) -> dict[str, float]:
        return self.stepping.last_metrics

    async def run(self, stop: asyncio.Event) -> None:
        """Read the stream and start a step as soon as a batch is complete. A step runs as its own
        task: the stream is read, decoded and judged meanwhile, so the next batch is ready the
        moment the step ends (details: docs/internals/trainer.md)."""
        await self.start(stop)
        delay = 0.2
        try:
            while not stop.is_set() and not self.done:
                try:
                    if self.paused:
                        await asyncio.sleep(0.1)
                        continue
                    await self.tend()
                    if not self.stepping.busy:  # groups that aged past the budget while held are not trained
                        await self.intake.drop_stale(self.settings.max_staleness)
                    ready = self.buffer.complete()
                    if not self.stepping.busy and len(ready) >= self.settings.batch_prompts:
                        self.stepping.begin(ready[: self.settings.batch_prompts])
                    waits = {self.reading.next()}
                    if self.stepping.busy:
                        waits.add(self.stepping.task)
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                    self.stepping.reap()
                    await self.reading.take()
                    delay = 0.2
                except redis.exceptions.RedisError as exc:  # Redis restarting or frozen: nothing is lost
                    self.reading.resync = True  # replies may be lost: entries delivered but never seen
                    log.warning("event=redis_unreachable error=%s retry_in=%.1fs", type(exc).__name__, delay)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 5.0)
        finally:
            await self.reading.stop()
            await self.stepping.finish()
        await self.publishing.finish(stop)
        await self.settling.finish()

    async def tend(self) -> None:
        """Each stage's upkeep, once a turn of the loop."""
        await self.reading.keep_in_sync()
        await self.publishing.reap()
        self.settling.tend()
        # beside a step: the reading, a checkpoint landing, a version's announcement; the rest (an
        # acknowledgement cut off, weight-sync's held check, a publish retried) after it: the step holds
        # the model lock and, while it saves, the acknowledgements' lock
        if self.stepping.busy:
            return
        await self.settling.acknowledge()
        await self.publishing.retry()
        if time.monotonic() - max(self.stepping.ended, self.waiting_logged) > 30:
            log.info(
                "event=waiting_for_rollouts held=%d complete_groups=%d", self.buffer.held, len(self.buffer.complete())
            )
            self.waiting_logged = time.monotonic()

    async def start(self, stop: asyncio.Event) -> None:
        """Continue the version numbering past anything already published (before any entry is
        judged against it), join the consumer group and take back what a previous trainer left
        pending."""
        while not stop.is_set():
            try:
                await self.publishing.resume()
                claimed = await self.reading.start()
                break
            except redis.exceptions.RedisError as exc:  # Redis may still be starting
                log.warning("event=redis_unreachable error=%s retry_in=1s", type(exc).__name__)
                await asyncio.sleep(1.0)
        else:
            return
        if self.settings.exact:  # the weights of the versions before this start are gone: their tokens uncheckable
            self.intake.oldest_checkable = self.state.version
        self.publishing.reported = self.progress()
        log.info(
            "event=trainer_ready step=%d version=%d claimed=%d recipe=%s",
            self.state.step,
            self.state.version,
            claimed,
            self.settings.recipe,
        )

    async def step(self, group_ids: list[str]) -> dict[str, float]:
        """One step, awaited to its end (its version announced)."""
        self.stepping.begin(group_ids)
        metrics = await self.stepping.carry()
        await self.publishing.announced()
        return metrics

    def progress(self) -> tuple[int, int, int]:
        """(step, version, rollouts trained) as of the last published version (what Status says)."""
        return self.publishing.progress()

    async def checkpoint_now(self) -> Path:
        async with self.model_lock:  # never half a step
            return await self.acks.save(self.state, wait=True)

    async def close(self) -> None:
        await self.publishing.close(self.settings.publish.timeout_seconds)
        await self.settling.close()
        self.steplog.close()
        await self.publisher.close()
