"""The run's owner: turns the dataset into prompt tasks under a staleness budget, sweeps expired leases, schedules
greedy evaluations and records their accuracy.

Everything it needs to resume lives in Redis (`run`). Tasks outstanding stay below (max_staleness + 1) × B prompts
for the trainer's version, and `lookahead_batches` × B more for versions to come, so no rollout is trained more than
max_staleness versions behind. Run state: created → running ⇄ paused → finished;
stop from any of the first three; failed (`stop_rules.py`) from running or paused. Each transition is one atomic
Redis script; `stopped`, `finished` and `failed` are final.

Details: docs/internals/orchestrator.md"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time

from prometheus_client import Counter, Gauge
from redis.asyncio import Redis

from services.orchestrator.config import OrchestratorSettings
from services.orchestrator.control import REPLY_MARGIN_SECONDS, Bounded, RedisUnavailable
from services.orchestrator.data import TRAIN_ID, Tasks
from services.orchestrator.evals import EvalRounds
from services.orchestrator.recovery import RedisWatch
from services.orchestrator.stop_rules import StopWatch, Verdict
from shared.rpc.steadyrl.v1 import common_pb2
from shared.runstore.keys import RunField, RunKeys
from shared.runstore.ledger import Ledger
from shared.runstore.queues import WorkQueue, given_up, now_ms

log = logging.getLogger("steadyrl.orchestrator")

SUBMITTED = Counter("steadyrl_orchestrator_tasks_submitted_total", "Train prompt tasks queued")
REQUEUED = Counter("steadyrl_orchestrator_tasks_requeued_total", "Tasks re-queued after a lease expired")
DEAD = Counter("steadyrl_orchestrator_tasks_dead_total", "Tasks given up after max_attempts")
FILTERED = Gauge(
    "steadyrl_orchestrator_tasks_filtered",
    "Train tasks whose group dynamic sampling filtered (equal rewards), each replaced by one more task",
)
OUTSTANDING = Gauge("steadyrl_orchestrator_outstanding_prompts", "Train prompts submitted and not yet done")
TRAINER_VERSION = Gauge("steadyrl_orchestrator_trainer_version", "Trainer version seen by admission")
TRAINER_STEP = Gauge("steadyrl_orchestrator_trainer_step", "Trainer global steps seen")
QUEUE_DEPTH = Gauge("steadyrl_orchestrator_queue_depth", "Work queue", ["state"])

STATES = ("created", "running", "paused", "stopped", "finished", "failed")
TRANSITIONS = {
    "start": (("created", "paused"), "running"),
    "pause": (("running",), "paused"),
    "resume": (("paused",), "running"),
    "stop": (("created", "running", "paused"), "stopped"),
    "finish": (("running",), "finished"),
    "fail": (("running", "paused"), "failed"),
}
RUN_FAILED = Gauge("steadyrl_orchestrator_run_failed", "1 once a stop rule failed the run, by rule", ["rule"])
STATUS_EVERY_MS = 2000  # the loop reads the status at least this often (the control plane's fallback)

# KEYS: run hash; ARGV: target, now_ms, deadline_ms (Redis's clock), allowed states... Returns
# {1, target}, {0, current}, or {-1, 'deadline'} when it runs past its deadline (and does nothing).
_TRANSITION = """
local now = redis.call('TIME')
if tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000) > tonumber(ARGV[3]) then
  return {-1, 'deadline'}
end
local current = redis.call('HGET', KEYS[1], '$STATE') or 'created'
for i = 4, #ARGV do
  if current == ARGV[i] then
    redis.call('HSET', KEYS[1], '$STATE', ARGV[1], ARGV[1] .. '_unix_ms', ARGV[2])
    return {1, ARGV[1]}
  end
end
return {0, current}
""".replace("$STATE", RunField.STATE)


class TransitionRefused(ValueError):
    def __init__(self, action: str, state: str) -> None:
        super().__init__(f"cannot {action} a run that is {state}")
        self.state = state


def min_versions(
    version: int, outstanding: int, ahead: dict[int, int], count: int, batch: int, max_staleness: int, lookahead: int
) -> tuple[list[int], dict[int, int]]:
    """The minimum policy version each of `count` new train tasks asks for, and `ahead` after them.

    `ahead`: the outstanding tasks asking for each version past `version` (the trainer's). A task
    may ask for version + k (1 ≤ k ≤ lookahead) once (max_staleness + k) × B outstanding tasks ask
    for less: those are trained first, so it is trained at version + k or later. Counted by version
    rather than by position, tasks ahead of it that are dropped as stale, filtered or dead get
    replacements the trainer can use now, and a trainer waiting for tasks always has
    (max_staleness + 1) × B that ask for no more than its version."""
    ahead = {v: n for v, n in ahead.items() if v > version}
    versions = []
    for _ in range(count):
        k = next(
            (
                k
                for k in range(lookahead, 0, -1)
                if outstanding - sum(n for v, n in ahead.items() if v >= version + k) >= (max_staleness + k) * batch
            ),
            0,
        )
        versions.append(version + k)
        if k:
            ahead[version + k] = ahead.get(version + k, 0) + 1
        outstanding += 1
    return versions, ahead


class Orchestrator:
    def __init__(self, settings: OrchestratorSettings, redis: Redis) -> None:
        self.settings = settings
        self.redis = redis
        self.queue = WorkQueue(redis, settings.run_id)
        self.keys = RunKeys(settings.run_id)
        self.ledger = Ledger(redis, settings.run_id)
        self.tasks = Tasks(settings)
        self.evals = EvalRounds(settings, redis, self.queue, self.tasks)
        self.trainer_version = self.trainer_step = 0
        self.trainer_metrics: dict[str, float] = {}
        self._transition = redis.register_script(_TRANSITION)
        self._channel = self._trainer = None  # grpc.aio: made in the event loop, on first use
        self.bounded = Bounded(settings.control.timeout_seconds)  # the control plane's bound and last status
        self.recovery = RedisWatch(settings, redis, self.queue, self.ledger, self.tasks, lambda: self.trainer_version)
        self.stop_watch = StopWatch(settings.stop)

    # --- run state ------------------------------------------------------------------------------

    async def field(self, name: str, default: str = "") -> str:
        value = await self.redis.hget(self.keys.run, name)
        return value.decode() if value is not None else default

    async def state(self) -> str:
        return await self.field(RunField.STATE, "created")

    async def transition(self, action: str) -> str:
        """Apply `action` atomically; raises TransitionRefused (naming the state) when not allowed,
        RedisUnavailable when Redis does not answer in time (then it was not applied, and never
        will be: services/orchestrator/control.py)."""
        allowed, target = TRANSITIONS[action]
        script = self._transition([self.keys.run], [target, now_ms(), self.bounded.deadline_ms(), *allowed])
        done, state = await self.bounded.call(action, script, margin=REPLY_MARGIN_SECONDS)
        state = state.decode() if isinstance(state, bytes) else state
        if done == -1:
            raise RedisUnavailable(action, "Redis ran it past its deadline", self.bounded.retry_after)
        if not done:
            raise TransitionRefused(action, state)
        log.info("event=run_state run=%s state=%s", self.settings.run_id, state)
        return state

    async def progress(self) -> dict[str, int]:
        """Train prompts submitted, trained (B per trainer step; the ledger lags until the trainer's
        next checkpoint), dropped as stale, filtered by dynamic sampling and dead (given up by the
        queue or by the trainer)."""
        g = self.settings.group_size
        ledger = await self.ledger.counts()
        submitted, dead = await self.redis.hmget(self.keys.run, [RunField.SUBMITTED, RunField.DEAD_TRAIN])
        trained = max(ledger.trained // g, self.trainer_step * self.settings.batch_prompts)
        dead_groups = sum(1 for gid in ledger.dead_groups if self._train_index(gid) is not None)
        return {
            "submitted": int(submitted or 0),
            "trained": trained,
            "dropped": ledger.dropped // g,
            "filtered": ledger.filtered // g,
            "dead": int(dead or 0) + dead_groups,
        }

    def _train_index(self, task_id: str) -> int | None:
        match = TRAIN_ID.match(task_id)
        return int(match.group(1)) if match else None

    # --- one tick -------------------------------------------------------------------------------

    async def refresh_trainer(self) -> None:
        """The trainer's step and published version (its Status; else its ledger)."""
        if self.settings.trainer_address and self._trainer is None:
            from shared.rpc import channel_options
            from shared.rpc.auth import channel
            from shared.rpc.steadyrl.v1 import trainer_pb2_grpc

            self._channel = channel(self.settings.trainer_address, options=channel_options())
            self._trainer = trainer_pb2_grpc.TrainerStub(self._channel)
        try:
            if self._trainer is None:
                raise LookupError("no trainer address")
            status = await self._trainer.Status(common_pb2.Empty(), timeout=2)
            self.trainer_version = status.version.version
            self.trainer_step = status.step
            self.trainer_metrics = dict(status.last_metrics)
        except Exception as exc:  # noqa: BLE001 - restarting or finished: fall back to its ledger
            log.debug("event=trainer_unreachable error=%s", type(exc).__name__)
            steps = (await self.ledger.counts()).trained // self.settings.group_size // self.settings.batch_prompts
            offset = self.trainer_version - self.trainer_step  # versions a restarted trainer numbered past steps
            self.trainer_step = max(self.trainer_step, steps)
            self.trainer_version = max(self.trainer_version, steps + offset)
        TRAINER_VERSION.set(self.trainer_version)
        TRAINER_STEP.set(self.trainer_step)

    async def sweep(self) -> None:
        requeued, dead = await self.queue.requeue_expired(self.settings.max_attempts)
        REQUEUED.inc(requeued)
        DEAD.inc(dead)
        if requeued or dead:
            log.info("event=leases_expired requeued=%d dead=%d", requeued, dead)

    async def count_dead(self) -> None:
        """Fold new entries of the task dead-letter stream into the count of dead train tasks (the
        cursor moves in the same transaction as the count)."""
        cursor = await self.field(RunField.DEAD_CURSOR, "0-0")
        reply = await self.redis.xread({self.keys.dead: cursor}, count=4096)
        if not reply:
            return
        entries = reply[0][1]
        submitted = int(await self.field(RunField.SUBMITTED, "0"))
        train = sum(
            1
            for _, f in entries
            if (i := self._train_index(f.get(b"task_id", b"").decode(errors="replace"))) is not None
            and i < submitted
            and given_up(f)
        )
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hincrby(self.keys.run, RunField.DEAD_TRAIN, train).hset(
                self.keys.run, RunField.DEAD_CURSOR, entries[-1][0]
            )
            await pipe.execute()

    async def admit(self, p: dict[str, int] | None = None) -> int:
        """Queue train tasks up to the staleness budget and `lookahead_batches` beyond it, each
        asking for its minimum version (`min_versions`); returns how many were queued. `p`: this
        tick's progress, read again when not given."""
        s = self.settings
        p = p or await self.progress()
        outstanding = p["submitted"] - (p["trained"] + p["dropped"] + p["filtered"] + p["dead"])
        budget = (s.max_staleness + 1 + s.lookahead_batches) * s.batch_prompts - outstanding
        if s.steps:
            budget = min(budget, s.steps * s.batch_prompts - p["trained"] - outstanding)
        OUTSTANDING.set(outstanding)
        FILTERED.set(p["filtered"])  # each filtered task is replaced: not trained, it leaves the budget
        if budget <= 0:
            return 0
        ahead = {int(v): n for v, n in json.loads(await self.field(RunField.AHEAD, "{}")).items()}
        versions, ahead = min_versions(
            self.trainer_version, outstanding, ahead, budget, s.batch_prompts, s.max_staleness, s.lookahead_batches
        )
        tasks = self.tasks.make_trains(p["submitted"], versions)
        submitted = p["submitted"] + len(tasks)
        record = {
            RunField.SUBMITTED: submitted,
            RunField.EPOCH: self.tasks.epoch(submitted),
            RunField.AHEAD: json.dumps(ahead),
        }
        await self.queue.submit_many(tasks, (self.keys.run, record))
        SUBMITTED.inc(len(tasks))
        return len(tasks)

    async def finished(self) -> bool:
        if not self.settings.steps or self.trainer_step < self.settings.steps:
            return False
        return await self.evals.all_written(self.trainer_step)

    async def tick(self) -> None:
        state = await self.state()
        await self.refresh_trainer()
        await self.recovery.tick()
        await self.sweep()
        await self.count_dead()
        await self.evals.collect()
        p = await self.progress() if state == "running" else None  # one read a tick: only this service submits
        if p is not None and (verdict := await self.judge(p)) is not None:
            await self.fail(verdict)
            state = "failed"
        if state == "running":
            await self.evals.schedule(self.trainer_step, self.trainer_version)
            if await self.evals.baseline_written():  # the step-0 eval runs on version 0 alone
                await self.admit(p)
            if await self.finished():
                try:
                    await self.transition("finish")
                except TransitionRefused as exc:  # stopped or paused meanwhile: theirs is final
                    log.info("event=finish_refused state=%s", exc.state)
        depths = await self.queue.depths()
        for name, depth in dataclasses.asdict(depths).items():
            QUEUE_DEPTH.labels(name).set(depth)
        if now_ms() - self.bounded.last_status_ms >= STATUS_EVERY_MS:  # what GET /v1/run shows if Redis freezes
            await self.bounded.measure_clock(self.redis)
            self.bounded.keep(await self.status())

    async def judge(self, p: dict[str, int]) -> Verdict | None:
        """The stop rules on this tick's counts (stop_rules.py)."""
        return self.stop_watch.observe(
            time.monotonic(), p["trained"], p["dead"], self.trainer_step, self.trainer_metrics
        )

    async def fail(self, verdict: Verdict) -> None:
        """Fail the run with the verdict's reason (written first, in the run hash: GET /v1/run shows
        it with the failed state)."""
        await self.redis.hset(
            self.keys.run, RunField.FAILURE, json.dumps({"rule": verdict.rule, "reason": verdict.reason})
        )
        try:
            await self.transition("fail")
        except TransitionRefused as exc:  # stopped or finished meanwhile: theirs stands
            await self.redis.hdel(self.keys.run, RunField.FAILURE)
            log.info("event=fail_refused state=%s rule=%s", exc.state, verdict.rule)
            return
        RUN_FAILED.labels(verdict.rule).set(1)
        log.error("event=run_failed run=%s rule=%s reason=%s", self.settings.run_id, verdict.rule, verdict.reason)

    async def run(self, stop: asyncio.Event) -> None:
        created = await self.redis.hsetnx(self.keys.run, RunField.CREATED_UNIX_MS, now_ms())
        if created:
            await self.redis.hset(self.keys.run, RunField.CONFIG, self.config_json())
        else:
            log.info(
                "event=resumed run=%s state=%s progress=%s",
                self.settings.run_id,
                await self.state(),
                await self.progress(),
            )
        await self.evals.restore()
        if self.settings.autostart:
            with contextlib.suppress(TransitionRefused):  # already running, paused by an operator, or over
                await self.transition("start")
        while not stop.is_set():
            started = time.monotonic()
            try:
                await self.tick()
            except Exception as exc:  # noqa: BLE001 - Redis restarts etc.: log, back off, keep going
                log.warning("event=tick_failed error=%s detail=%s", type(exc).__name__, exc)
                await asyncio.sleep(1.0)
            await asyncio.sleep(max(0.0, self.settings.tick_seconds - (time.monotonic() - started)))

    def config_json(self) -> str:
        return self.settings.model_dump_json(exclude={"token", "redis_url"})

    async def status(self) -> dict:
        depths = await self.queue.depths()
        replicas = {k.decode(): int(v) for k, v in (await self.redis.hgetall(self.keys.replicas)).items()}
        state = await self.state()
        failure = await self.field(RunField.FAILURE) if state == "failed" else ""
        return {
            "run_id": self.settings.run_id,
            "state": state,
            "trainer_version": self.trainer_version,
            "trainer_step": self.trainer_step,
            "replica_versions": replicas,
            "progress": await self.progress(),
            "queue": dataclasses.asdict(depths),
            "dead_letters": {
                "tasks": await self.queue.dead_counts(),
                "rollouts": await self.ledger.rollouts_dead_counts(),
            },
            "epoch": int(await self.field(RunField.EPOCH, "0")),
            "staleness": {
                k: self.trainer_metrics[k]
                for k in ("staleness_mean", "staleness_peak", "dropped_stale")
                if k in self.trainer_metrics
            },
            "last_metrics": self.trainer_metrics,
            "evals": self.evals.accuracies(),
            **({"failure": json.loads(failure)} if failure else {}),
            **({"policy_evals": self.evals.accuracies(policy=True)} if self.settings.evals.policy else {}),
        }

    async def close(self) -> None:
        self.evals.scalars.close()
        if self._channel is not None:
            await self._channel.close()
