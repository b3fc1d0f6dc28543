"""The trainer's loop: rollout stream → complete groups → one global step → checkpoint → publish.

A rollout is acknowledged (XACK and the `trained` ledger, in one script) only once a checkpoint holding its update
and its id is named by `LATEST`: no rollout is trained twice into the surviving model, none is skipped. Every step
publishes a version; a trainer restarted from an older checkpoint publishes past the newest published number
(`VersionPublisher.newest_published`), never reusing one.

Details: docs/internals/trainer.md"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import redis.exceptions
from redis.asyncio import Redis

from services.trainer.acknowledgements import Acknowledgements
from services.trainer.config import TrainerSettings
from services.trainer.final_model import write_final_model
from services.trainer.global_step import NonFiniteStep
from services.trainer.groups import GroupBuffer
from services.trainer.intake import Intake
from services.trainer.model_runner import StepRunner
from services.trainer.replica_idle import ReplicaIdle
from services.trainer.step_log import StepLog, reward_metrics, trajectory_metrics
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
        self.replica_idle = ReplicaIdle(redis, RunKeys(s.run_id).replica_idle)
        self.acks = Acknowledgements(self.runner, self.source)  # trained, checkpointed, acknowledged
        self.redis_id = ""
        self.checked_redis = 0.0
        self.resync = False
        self.paused = False
        self.last_metrics = {}
        self.steplog = StepLog(
            settings.out_dir,
            settings.tensorboard,
            settings.stall_alert_seconds,
            settings.tracking,
            settings.run_id,
            settings.model_dump(mode="json"),
            settings.max_staleness,
        )
        if self.runner.rank == 0:  # the rank that writes the lines (the others follow its commands)
            self.steplog.resume(self.state.step)
        self.reported = self.progress()
        self.model_lock = asyncio.Lock()  # one of: a step (train, checkpoint, publish), a Checkpoint request
        self.last_step = self.next_publish = self.next_held_check = time.monotonic()
        self.step_ended = self.cycle_started = self.last_step  # the idle share: waiting for rollouts (_train)
        self.after_last_step: dict[str, float] = {}  # the last step's checkpoint and publish seconds
        self.stepping: asyncio.Task | None = None  # the step under way
        self.announcing: asyncio.Task | None = None  # the version on its way out (Trainer.publish)
        self.settling: asyncio.Task | None = None  # a checkpoint put in place, its rollouts acknowledged

    @property
    def done(self) -> bool:
        return bool(self.settings.max_steps) and self.state.step >= self.settings.max_steps

    async def run(self, stop: asyncio.Event) -> None:
        """Read the stream and start a step as soon as a batch is complete. A step runs as its own
        task: the stream is read, decoded and judged meanwhile, so the next batch is ready the
        moment the step ends (details: docs/internals/trainer.md)."""
        await self.start(stop)
        delay = 0.2
        reading: asyncio.Future | None = None
        try:
            while not stop.is_set() and not self.done:
                try:
                    if self.paused:
                        await asyncio.sleep(0.1)
                        continue
                    await self.keep_in_sync()
                    ready = self.buffer.complete()
                    if self.stepping is None and len(ready) >= self.settings.batch_prompts:
                        self.stepping = self.begin_step(ready[: self.settings.batch_prompts])
                    if reading is None:
                        reading = asyncio.ensure_future(self.source.read(self.settings.stream.read_block_ms))
                    waits = {reading} if self.stepping is None else {reading, self.stepping}
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                    if self.stepping is not None and self.stepping.done():
                        ended, self.stepping = self.stepping, None
                        ended.result()
                    if reading.done():
                        done, reading = reading, None
                        await self.intake.take(done.result())
                        await self.intake.drop_stale(self.settings.max_staleness)
                        if self.settings.filter_cap:
                            await self.intake.filter_equal(self.settings.filter_cap)
                    delay = 0.2
                except redis.exceptions.RedisError as exc:  # Redis restarting or frozen: nothing is lost
                    self.resync = True  # replies may be lost: entries delivered but never seen
                    log.warning("event=redis_unreachable error=%s retry_in=%.1fs", type(exc).__name__, delay)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 5.0)
        finally:
            if reading is not None:
                reading.cancel()  # what it read stays pending in the group: claimed on the next start
                await asyncio.gather(reading, return_exceptions=True)
            if self.stepping is not None:  # carried to its end (see `carried`)
                ended, self.stepping = self.stepping, None
                with contextlib.suppress(Exception):
                    await self.carried(ended)
        await self.announced()
        while self.publisher.published < self.state.version and not stop.is_set():  # the last version
            await self.publish()
            await self.announced()
        if self.settling is not None:
            with contextlib.suppress(redis.exceptions.RedisError):
                await self.settling
            self.settling = None
        if self.acks.saving is not None:  # a stop lets the checkpoint under way land (it is on disk soon)
            with contextlib.suppress(redis.exceptions.RedisError):
                await self.acks.settle(wait=True)

    async def start(self, stop: asyncio.Event) -> None:
        """Continue the version numbering past anything already published (before any entry is
        judged against it), join the consumer group and take back what a previous trainer left
        pending."""
        while not stop.is_set():
            try:
                self.state.version = await self.publisher.resume(self.state.version)
                await self.source.open()
                self.buffer.dead_groups |= await self.source.dead_groups()
                claimed = await self.intake.claim_all()
                self.redis_id = await self.source.identity()
                break
            except redis.exceptions.RedisError as exc:  # Redis may still be starting
                log.warning("event=redis_unreachable error=%s retry_in=1s", type(exc).__name__)
                await asyncio.sleep(1.0)
        else:
            return
        self.reported = self.progress()
        log.info(
            "event=trainer_ready step=%d version=%d claimed=%d recipe=%s",
            self.state.step,
            self.state.version,
            claimed,
            self.settings.recipe,
        )

    async def keep_in_sync(self) -> None:
        """Redis restarts and lost replies, a cut-off acknowledgement, an unpublished version."""
        if time.monotonic() - self.checked_redis >= 1.0:
            self.checked_redis = time.monotonic()
            identity = await self.source.identity()
            if identity != self.redis_id:  # Redis restarted: it may have lost acknowledged writes
                await self.intake.reconcile({rid for _, rid in self.acks.pending()})
                self.redis_id = identity
                self.resync = False
        if self.resync:
            log.info("event=resynced claimed=%d", await self.intake.claim_all())
            self.resync = False
        if self.announcing is not None and self.announcing.done():
            await self.announced()
        if self.settling is not None and self.settling.done():
            ended, self.settling = self.settling, None
            ended.result()
        if self.settling is None and self.acks.save_done():  # no model needed: beside a step
            self.settling = asyncio.ensure_future(self.acks.settle(wait=False))
        if self.stepping is not None:  # the rest needs the model: after the step
            return
        if self.acks.saved and self.settling is None:  # an acknowledgement cut off (Redis restarting or frozen)
            await self.acks.acknowledge()
        if self.publisher.enabled and self.announcing is None and time.monotonic() >= self.next_held_check:
            self.next_held_check = time.monotonic() + 3.0
            await self.publisher.held_by_weightsync()
        if (
            self.announcing is None
            and self.publisher.published < self.state.version
            and time.monotonic() >= self.next_publish
        ):
            async with self.model_lock:
                await self.publish()
        if time.monotonic() - self.last_step > 30:
            log.info(
                "event=waiting_for_rollouts held=%d complete_groups=%d", self.buffer.held, len(self.buffer.complete())
            )
            self.last_step = time.monotonic()

    def begin_step(self, group_ids: list[str]) -> asyncio.Task:
        """Start one step on these complete groups, taken from the buffer at once (before the loop
        reads the stream again, which may drop or filter groups)."""
        groups = self.buffer.take(group_ids)
        self.intake.training = {m.rollout.rollout_id for group in groups for m in group}
        return asyncio.ensure_future(self._train(groups))

    async def step(self, group_ids: list[str]) -> dict[str, float]:
        """One step, awaited to its end (its version announced)."""
        metrics = await self.carried(self.begin_step(group_ids))
        await self.announced()
        return metrics

    async def carried(self, step: asyncio.Task) -> dict[str, float]:
        """Wait for a step, carried to its end (its checkpoint too) even when the waiter is
        cancelled meanwhile (a clean stop): the training thread cannot be interrupted, and a model
        updated without its bookkeeping would be checkpointed as the step before, its rollouts
        trained again after a restart."""
        try:
            return await asyncio.shield(step)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await step
                if self.acks.saving is not None:  # its checkpoint lands and acknowledges it
                    await self.acks.settle(wait=True)
            raise

    async def _train(self, groups: list[list]) -> dict[str, float]:
        started = time.perf_counter()
        now = time.monotonic()  # since the last step ended (its checkpoint and publish too) the trainer waited
        waited = now - self.step_ended
        idle_share = waited / max(now - self.cycle_started, 1e-9)  # of the time since the last step started
        self.cycle_started = now
        replica_idle = await self.replica_idle.share()
        filtered = self.intake.filtered_this_step  # groups dynamic sampling filtered while this batch filled
        self.intake.next_step()
        rollouts = [m.rollout for group in groups for m in group]
        log.info("event=step_started step=%d rollouts=%d", self.state.step + 1, len(rollouts))
        async with self.model_lock:  # a Checkpoint request waits for the step, never saves half of one
            try:
                metrics = await asyncio.to_thread(self.runner.step, rollouts, self.state.version)
            except NonFiniteStep as exc:  # nothing applied: no step, no version; its rollouts dead-lettered
                await self.intake.nonfinite(groups, exc.reason)
                self.last_step = self.step_ended = time.monotonic()
                return {"nonfinite_step": 1.0}
            self.state.step += 1
            self.state.version += 1
            self.state.consumed.update(r.rollout_id for r in rollouts)
            self.acks.trained([(m.entry, m.rollout.rollout_id) for group in groups for m in group])
            seconds = time.perf_counter() - started
            metrics.update(
                step=self.state.step,
                version=self.state.version,
                step_seconds=seconds,
                tokens_per_s=metrics["tokens"] / max(seconds, 1e-9),
                dropped_stale=self.state.counters.get("dropped_stale", 0),
                trainer_wait_seconds=waited,
                trainer_idle_share=idle_share,
                **({} if replica_idle is None else {"replica_idle_share": replica_idle}),
                zero_variance_share=sum(self.buffer.equal(g) for g in groups) / len(groups),
                **(
                    {"filtered_groups": filtered, "filtered_share": filtered / (filtered + len(groups))}
                    if self.settings.filter_cap
                    else {}
                ),
                **reward_metrics(rollouts),
                **trajectory_metrics(rollouts),
                **self.after_last_step,  # its checkpoint and publish follow the line: in the next one
            )
            # the step's line before the checkpoint that acknowledges its rollouts: a step that
            # survives has its line (one the crash takes back is cut on resume: StepLog.resume)
            self.steplog.record(metrics, len(rollouts), self.runner.recipe)
            self.last_metrics = metrics
            saving = time.perf_counter()
            if self.state.step % self.settings.checkpoint.every == 0 or self.done:
                await self.acks.save(self.state, wait=self.done)
            if self.done and self.runner.world == 1 and not self.settings.lora.rank:  # the whole model, as is
                await asyncio.to_thread(
                    write_final_model,
                    self.runner.model,
                    self.settings.model_path,
                    self.settings.out_dir,
                    self.state.step,
                )
            publishing = time.perf_counter()
            await self.publish()
            self.after_last_step = {
                "checkpoint_seconds": publishing - saving,  # the final model's write included
                "publish_seconds": time.perf_counter() - publishing,
            }
        self.last_step = self.step_ended = time.monotonic()
        log.info(
            "event=step step=%d version=%d reward=%.3f kl_k3=%.2e step_seconds=%.2f seconds=%.2f",
            metrics["step"],
            metrics["version"],
            metrics["reward_mean"],
            metrics["mismatch_kl_k3"],
            metrics["step_seconds"],
            time.perf_counter() - started,
        )
        return metrics

    async def publish(self) -> None:
        """Publish the current weights as the current version (call with the model lock held): what
        reads the weights now, the rest (shm: the announcement) in the background (`announcing`),
        after the previous version's, while the next step runs. On failure the next turn of the
        loop tries again, two seconds later at the earliest."""
        await self.announced()
        weights = self.runner.weights() if self.publisher.enabled else {}
        staged = self.state.step, self.state.version, len(self.state.consumed)  # Status, once it is out
        complete = await self.publisher.stage(weights, self.state.version)
        self.announcing = asyncio.ensure_future(self._announce(complete, staged))

    async def _announce(self, complete: Callable[[], Awaitable[bool]], staged: tuple[int, int, int]) -> None:
        if not await complete():
            self.next_publish = time.monotonic() + 2.0
            await asyncio.sleep(0.5)
        step, version, trained = staged
        self.reported = step, min(version, self.publisher.published), trained

    async def announced(self) -> None:
        """The version on its way out is out (or failed: `next_publish` retries it)."""
        if self.announcing is not None:
            try:
                await asyncio.shield(self.announcing)  # a cancelled waiter leaves it to finish
            finally:
                if self.announcing is not None and self.announcing.done():
                    self.announcing = None

    def progress(self) -> tuple[int, int, int]:
        """(step, version, rollouts trained) as of the last published version (what Status says)."""
        return self.state.step, min(self.state.version, self.publisher.published), len(self.state.consumed)

    async def checkpoint_now(self) -> Path:
        async with self.model_lock:  # never half a step
            return await self.acks.save(self.state, wait=True)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.announced(), self.settings.publish.timeout_seconds)
        if self.settling is not None:  # a run that ended by an error: its checkpoint's landing, seen to
            with contextlib.suppress(Exception):
                await self.settling
        self.steplog.close()
        await self.publisher.close()
