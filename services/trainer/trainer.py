"""The trainer's loop: rollout stream → complete groups → one global step → checkpoint → publish.

Durability: a rollout is acknowledged (XACK, and appended to the `trained` ledger in the same
script) only once a checkpoint that includes its update and its id is on disk; a crash leaves it
pending, and the restarted trainer claims it back and trains it again into the surviving model
(or, if the checkpoint lists its id, only acknowledges it). No rollout is trained twice into the
model that survives, none is skipped.

Versions: every step publishes a version, checkpointed or not (`checkpoint_every` > 1 saves
seconds per step). A trainer restarted from a checkpoint older than the newest published version
does not reuse those numbers: it publishes its checkpointed weights as the next number past them
(`VersionPublisher.newest_published`), and the replicas, which may hold weights of the lost steps,
switch to it. Rollouts sampled from the lost steps carry versions below the new one: they are
trained or dropped as stale by the usual rule, never refused as from the future.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from pathlib import Path

import redis.exceptions
from prometheus_client import Counter, Gauge, Histogram
from redis.asyncio import Redis

from services.trainer.config import TrainerSettings
from services.trainer.groups import GroupBuffer
from services.trainer.intake import Intake
from services.trainer.publisher import VersionPublisher
from services.trainer.steps import StepRunner
from services.trainer.stream import RolloutSource

log = logging.getLogger("steadyrl.trainer")
STEPS = Counter("steadyrl_trainer_steps_total", "Global steps trained")
VERSION = Gauge("steadyrl_trainer_policy_version", "Policy version after the last step")
TRAINED = Counter("steadyrl_trainer_rollouts_trained_total", "Rollouts trained")
LAST_STEP = Gauge("steadyrl_trainer_last_step_unix_seconds", "When the last global step finished")
RESTORED = Counter("steadyrl_trainer_ledger_restored_total",
                   "Ledger entries written again after Redis came back without them (a lost AOF window)")
STEP_SECONDS = Histogram("steadyrl_trainer_step_seconds", "Seconds per global step",
                         buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300))
LAST = Gauge("steadyrl_trainer_last_metric", "The last step's diagnostics", ["name"])


class Trainer:
    def __init__(self, settings: TrainerSettings, redis: Redis) -> None:
        self.settings = s = settings
        self.runner = StepRunner(settings)
        self.state = self.runner.restore()
        self.source = RolloutSource(redis, s.run_id, s.consumer, s.dead_letter_maxlen)
        self.buffer = GroupBuffer(s.group_size, s.run_id, self.runner.limits)
        self.intake = Intake(self.source, self.buffer, self.state)
        self.publisher = VersionPublisher(settings, redis)
        self.unacked: list[tuple[bytes, str]] = []  # trained, waiting for a checkpoint: (entry id, rollout id)
        self.redis_id, self.checked_redis, self.resync = "", 0.0, False
        self.paused, self.last_metrics = False, {}
        self.reported = self.progress()
        self.model_lock = asyncio.Lock()  # one of: a step (train, checkpoint, publish), a Checkpoint request
        self.last_step = self.next_publish = time.monotonic()

    @property
    def done(self) -> bool:
        return bool(self.settings.max_steps) and self.state.step >= self.settings.max_steps

    async def run(self, stop: asyncio.Event) -> None:
        await self.start(stop)
        delay = 0.2
        while not stop.is_set() and not self.done:
            try:
                if self.paused:
                    await asyncio.sleep(0.1)
                    continue
                await self.keep_in_sync()
                await self.intake.take(await self.source.read(self.settings.read_block_ms))
                await self.intake.drop_stale(self.settings.max_staleness)
                ready = self.buffer.complete()
                if len(ready) >= self.settings.batch_prompts:
                    await self.step(ready[: self.settings.batch_prompts])
                delay = 0.2
            except redis.exceptions.RedisError as exc:  # Redis restarting or frozen: nothing is lost
                self.resync = True  # replies may be lost: entries delivered but never seen
                log.warning("event=redis_unreachable error=%s retry_in=%.1fs", type(exc).__name__, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
        while self.publisher.published < self.state.version and not stop.is_set():  # the last version
            await self.publish()

    async def start(self, stop: asyncio.Event) -> None:
        """Continue the version numbering past anything already published (before any entry is
        judged against it), join the consumer group and take back what a previous trainer left
        pending."""
        while not stop.is_set():
            try:
                published = await self.publisher.newest_published()
                if published > self.state.version:
                    log.warning("event=version_continues checkpoint_version=%d published=%d version=%d",
                                self.state.version, published, published + 1)
                    self.state.version = published + 1
                self.publisher.published = min(published, self.state.version) if self.publisher.enabled \
                    else self.state.version
                await self.source.ensure_group()
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
        log.info("event=trainer_ready step=%d version=%d claimed=%d recipe=%s", self.state.step, self.state.version,
                 claimed, self.settings.recipe)

    async def keep_in_sync(self) -> None:
        """Redis restarts and lost replies, a cut-off acknowledgement, an unpublished version."""
        if time.monotonic() - self.checked_redis >= 1.0:
            self.checked_redis = time.monotonic()
            identity = await self.source.identity()
            if identity != self.redis_id:
                await self.reconcile()
                self.redis_id, self.resync = identity, False
        if self.resync:
            log.info("event=resynced claimed=%d", await self.intake.claim_all())
            self.resync = False
        if self.unacked and self.state.step % self.settings.checkpoint_every == 0:
            await self.acknowledge()
        if self.publisher.published < self.state.version and time.monotonic() >= self.next_publish:
            async with self.model_lock:
                await self.publish()
        if time.monotonic() - self.last_step > 30:
            log.info("event=waiting_for_rollouts held=%d complete_groups=%d", self.buffer.held,
                     len(self.buffer.complete()))
            self.last_step = time.monotonic()

    async def reconcile(self) -> None:
        """Redis restarted. With appendfsync everysec a host crash loses up to the last second of
        acknowledged writes, here acknowledgements and ledger entries of trained rollouts: claim
        what is pending again, then write back every checkpointed id the ledger lacks."""
        claimed = await self.intake.claim_all()
        acked = sorted(self.state.consumed - {rid for _, rid in self.unacked})
        restored = 0
        for start in range(0, len(acked), 4096):
            restored += await self.source.trained([("", rid) for rid in acked[start : start + 4096]])
        RESTORED.inc(restored)
        self.intake.count("ledger_restored", restored)
        log.warning("event=redis_restarted claimed=%d ledger_restored=%d", claimed, restored)

    async def step(self, group_ids: list[str]) -> dict[str, float]:
        """One step, carried to its end even when the loop is cancelled meanwhile (a clean stop):
        the training thread cannot be interrupted, and a model updated without its bookkeeping
        would be checkpointed as the step before, its rollouts trained again after a restart."""
        step = asyncio.ensure_future(self._train(group_ids))
        try:
            return await asyncio.shield(step)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await step
            raise

    async def _train(self, group_ids: list[str]) -> dict[str, float]:
        started = time.perf_counter()
        groups = self.buffer.take(group_ids)
        rollouts = [m.rollout for group in groups for m in group]
        log.info("event=step_started step=%d rollouts=%d", self.state.step + 1, len(rollouts))
        async with self.model_lock:  # a Checkpoint request waits for the step, never saves half of one
            metrics = await asyncio.to_thread(self.runner.step, rollouts, self.state.version)
            self.state.step += 1
            self.state.version += 1
            self.state.consumed.update(r.rollout_id for r in rollouts)
            self.unacked.extend((m.entry, m.rollout.rollout_id) for group in groups for m in group)
            if self.state.step % self.settings.checkpoint_every == 0 or self.done:
                await self.save()
            await self.publish()
        seconds = time.perf_counter() - started
        metrics.update(step=self.state.step, version=self.state.version, step_seconds=seconds,
                       tokens_per_s=metrics["tokens"] / max(seconds, 1e-9),
                       dropped_stale=self.state.counters.get("dropped_stale", 0))
        self.record(metrics, len(rollouts))
        log.info("event=step step=%d version=%d reward=%.3f kl_k3=%.2e seconds=%.2f", metrics["step"],
                 metrics["version"], metrics["reward_mean"], metrics["mismatch_kl_k3"], metrics["step_seconds"])
        return metrics

    async def save(self) -> Path:
        """Checkpoint, then acknowledge what it holds. Call with the model lock held."""
        path = await asyncio.to_thread(self.runner.save, self.state)
        await self.acknowledge()
        return path

    async def acknowledge(self) -> None:
        await self.source.trained(self.unacked)
        self.unacked = []

    async def publish(self) -> None:
        """Publish the current weights as the current version (call with the model lock held);
        on failure the next turn of the loop tries again, two seconds later at the earliest."""
        if not await self.publisher.publish(self.runner.weights(), self.state.version):
            self.next_publish = time.monotonic() + 2.0
            await asyncio.sleep(0.5)
        self.reported = self.progress()

    def record(self, metrics: dict[str, float], rollouts: int) -> None:
        out = self.settings.out_dir
        out.mkdir(parents=True, exist_ok=True)
        with (out / "metrics.jsonl").open("a") as f:
            f.write(json.dumps({k: (round(v, 8) if isinstance(v, float) else v) for k, v in metrics.items()}
                               | {"recipe": self.runner.recipe}) + "\n")
        STEPS.inc()
        TRAINED.inc(rollouts)
        STEP_SECONDS.observe(metrics["step_seconds"])
        VERSION.set(self.state.version)
        LAST_STEP.set(time.time())
        for key, value in metrics.items():
            LAST.labels(key).set(value)
        self.last_metrics, self.last_step = metrics, time.monotonic()

    def progress(self) -> tuple[int, int, int]:
        """(step, version, rollouts trained) as of the last version published (Status reports it:
        a version is not announced before it exists)."""
        return self.state.step, min(self.state.version, self.publisher.published), len(self.state.consumed)

    async def checkpoint_now(self) -> Path:
        async with self.model_lock:
            return await self.save()

    async def close(self) -> None:
        await self.publisher.close()
