"""The stepping stage: one global step at a time, as a task of its own under the model lock (a Checkpoint request
never saves half of one): the training thread, the step's line, its checkpoint begun, its version staged. Its
timestamps give the next line's `trainer_wait_seconds` and `trainer_idle_share`; the checkpoint and the publish
follow the line, so the next line carries their seconds."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from services.trainer.acknowledgements import Acknowledgements
from services.trainer.checkpoint import TrainerState
from services.trainer.config import TrainerSettings
from services.trainer.final_model import write_final_model
from services.trainer.global_step import StepNotApplied
from services.trainer.groups import GroupBuffer
from services.trainer.intake import Intake
from services.trainer.model_runner import StepRunner
from services.trainer.replica_idle import ReplicaIdle
from services.trainer.stages.publishing import Publishing
from services.trainer.stages.settling import Settling
from services.trainer.step_log import StepLog, reward_metrics, trajectory_metrics

log = logging.getLogger("steadyrl.trainer")


class Stepping:
    def __init__(
        self,
        settings: TrainerSettings,
        *,
        runner: StepRunner,
        state: TrainerState,
        buffer: GroupBuffer,
        intake: Intake,
        acks: Acknowledgements,
        steplog: StepLog,
        replica_idle: ReplicaIdle,
        settling: Settling,
        publishing: Publishing,
        model_lock: asyncio.Lock,
    ) -> None:
        self.settings = settings
        self.runner = runner
        self.state = state
        self.buffer = buffer
        self.intake = intake
        self.acks = acks
        self.steplog = steplog
        self.replica_idle = replica_idle
        self.settling = settling
        self.publishing = publishing
        self.model_lock = model_lock
        self.task: asyncio.Task | None = None  # the step under way
        self.ended = time.monotonic()  # the last step ended (its checkpoint and publish too)
        self.cycle_started = self.ended  # the last step started
        self.after_last: dict[str, float] = {}  # the last step's checkpoint and publish seconds
        self.last_metrics: dict[str, float] = {}

    @property
    def done(self) -> bool:
        return bool(self.settings.max_steps) and self.state.step >= self.settings.max_steps

    @property
    def busy(self) -> bool:
        return self.task is not None

    def begin(self, group_ids: list[str]) -> None:
        """Start one step on these complete groups, taken from the buffer at once (before the loop
        reads the stream again, which may drop or filter groups)."""
        groups = self.buffer.take(group_ids)
        self.intake.training = {m.rollout.rollout_id for group in groups for m in group}
        self.task = asyncio.ensure_future(self._train(groups))

    def reap(self) -> None:
        """The step that ended forgotten (its error raised)."""
        if self.task is not None and self.task.done():
            ended, self.task = self.task, None
            ended.result()

    async def carry(self) -> dict[str, float]:
        """Wait for the step under way, carried to its end (its checkpoint too) even when the waiter
        is cancelled meanwhile (a clean stop): the training thread cannot be interrupted, and a model
        updated without its bookkeeping would be checkpointed as the step before, its rollouts
        trained again after a restart."""
        step, self.task = self.task, None
        try:
            return await asyncio.shield(step)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await step
                await self.settling.land()  # its checkpoint lands and acknowledges it
            raise

    async def finish(self) -> None:
        """A stop: the step under way carried to its end (an error of its own does not hold the stop up)."""
        if self.task is not None:
            with contextlib.suppress(Exception):
                await self.carry()

    async def _train(self, groups: list[list]) -> dict[str, float]:
        started = time.perf_counter()
        now = time.monotonic()  # since the last step ended (its checkpoint and publish too) the trainer waited
        waited = now - self.ended
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
            except StepNotApplied as exc:  # nothing applied: no step, no version; its rollouts dead-lettered
                await self.intake.not_applied(groups, exc.code, exc.reason)
                self.ended = time.monotonic()
                return {exc.code: 1.0}
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
                **self.after_last,  # its checkpoint and publish follow the line: in the next one
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
            await self.publishing.publish()
            self.after_last = {
                "checkpoint_seconds": publishing - saving,  # the final model's write included
                "publish_seconds": time.perf_counter() - publishing,
            }
        self.ended = time.monotonic()
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
