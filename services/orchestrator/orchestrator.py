"""The run's owner: turns the dataset into prompt tasks under a staleness budget, sweeps expired
leases, schedules greedy evaluations and records their accuracy.

Everything it needs to resume lives in Redis (`run`): a restarted orchestrator counts what the
trainer's ledger says was trained or dropped and what the dead-letter streams hold, and continues
with the next task number, so no task is lost or submitted twice.

Admission (AReaL-style): tasks outstanding (submitted, not yet trained, dropped or dead) stay
below (max_staleness + 1) × B prompts, and each task asks for at least the trainer's published
version at submission, so no rollout is ever more than max_staleness versions behind when it is
trained. Progress and evaluations follow the trainer's steps (a restarted trainer may number its
versions past the steps it lost; see services/trainer/trainer.py).

Run state: created → running ⇄ paused → finished; stop from any of the first three. Every
transition is one atomic Redis script, and `stopped` and `finished` are final.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time

from prometheus_client import Counter, Gauge
from redis.asyncio import Redis

from services.orchestrator.config import OrchestratorSettings
from shared.keys import RunKeys
from shared.models import load_tokenizer
from shared.models.loading import encode_prompt
from shared.queues import WorkQueue, now_ms
from shared.rollout import RolloutError, decode_rollout
from shared.rpc.steadyrl.v1 import common_pb2
from shared.tasks import ArithTask, Example, MathTask

log = logging.getLogger("steadyrl.orchestrator")

SUBMITTED = Counter("steadyrl_orchestrator_tasks_submitted_total", "Prompt tasks queued", ["kind"])
REQUEUED = Counter("steadyrl_orchestrator_tasks_requeued_total", "Tasks re-queued after a lease expired")
DEAD = Counter("steadyrl_orchestrator_tasks_dead_total", "Tasks given up after max_attempts")
EVAL_REFUSED = Counter("steadyrl_orchestrator_eval_rollouts_refused_total", "Eval rollouts that fit no eval round",
                       ["reason"])
OUTSTANDING = Gauge("steadyrl_orchestrator_outstanding_prompts", "Train prompts submitted and not yet done")
TRAINER_VERSION = Gauge("steadyrl_orchestrator_trainer_version", "Trainer version seen by admission")
TRAINER_STEP = Gauge("steadyrl_orchestrator_trainer_step", "Trainer global steps seen")
QUEUE_DEPTH = Gauge("steadyrl_orchestrator_queue_depth", "Work queue", ["state"])
EVAL_ACCURACY = Gauge("steadyrl_orchestrator_eval_accuracy", "Greedy accuracy of the last eval round")

STATES = ("created", "running", "paused", "stopped", "finished")
TRANSITIONS = {"start": (("created", "paused"), "running"), "pause": (("running",), "paused"),
               "resume": (("paused",), "running"), "stop": (("created", "running", "paused"), "stopped"),
               "finish": (("running",), "finished")}
TRAIN_ID = re.compile(r"^train-(\d+)$")
EVAL_ID = re.compile(r"^eval-(\d+)-(\d+)$")

# KEYS: run hash; ARGV: target, now_ms, allowed states... Returns {1, target} or {0, current}.
_TRANSITION = """
local current = redis.call('HGET', KEYS[1], 'state') or 'created'
for i = 3, #ARGV do
  if current == ARGV[i] then
    redis.call('HSET', KEYS[1], 'state', ARGV[1], ARGV[1] .. '_unix_ms', ARGV[2])
    return {1, ARGV[1]}
  end
end
return {0, current}
"""


class TransitionRefused(ValueError):
    def __init__(self, action: str, state: str) -> None:
        super().__init__(f"cannot {action} a run that is {state}")
        self.state = state


def dataset(settings: OrchestratorSettings) -> tuple[list[Example], list[Example], str]:
    """(train, eval, reward) of the run; train and eval never share a problem unless allowed."""
    if settings.task == "arith":
        task = ArithTask(digits=settings.arith_digits, seed=settings.task_seed,
                         fixed_width=settings.arith_fixed_width, reverse=settings.arith_reverse)
        train = task.split("train", min(settings.train_size, task.max_split_size("train")))
        return train, task.split("eval", min(settings.eval_size, task.max_split_size("eval"))), "exact_match"
    if settings.math_path is None:
        raise ValueError("task 'math' needs math_path")
    task = MathTask(str(settings.math_path), str(settings.math_eval_path) if settings.math_eval_path else None)
    if settings.math_eval_path is None:  # hold the last eval_size rows out of training
        rows = task.split("train")
        if len(rows) <= settings.eval_size:
            raise ValueError(f"{settings.math_path} has {len(rows)} rows: too few to hold out eval_size="
                             f"{settings.eval_size} for evaluation (or give math_eval_path)")
        return rows[: -settings.eval_size][: settings.train_size], rows[-settings.eval_size:], "math_verify"
    train, evals = task.split("train", settings.train_size), task.split("eval", settings.eval_size)
    overlap = {e.prompt for e in train} & {e.prompt for e in evals}
    if overlap and not settings.allow_eval_overlap:
        raise ValueError(f"{len(overlap)} eval problems are also training problems (e.g. "
                         f"{next(iter(overlap))[:80]!r}); evals would measure memorisation. Remove them or set "
                         "allow_eval_overlap = true")
    return train, evals, "math_verify"


class Orchestrator:
    def __init__(self, settings: OrchestratorSettings, redis: Redis) -> None:
        self.settings, self.redis = settings, redis
        self.queue = WorkQueue(redis, settings.run_id)
        self.keys = RunKeys(settings.run_id)
        self.train, self.eval, self.reward = dataset(settings)
        self.tokenizer = load_tokenizer(settings.model_path)
        self.trainer_version = self.trainer_step = 0
        self.trainer_metrics: dict[str, float] = {}
        self.eval_results: dict[int, dict[str, float]] = {}
        self._eval_cursor = "0-0"
        self._transition = redis.register_script(_TRANSITION)
        self._channel = self._trainer = None  # grpc.aio: made in the event loop, on first use

    # --- run state ------------------------------------------------------------------------------

    async def field(self, name: str, default: str = "") -> str:
        value = await self.redis.hget(self.keys.run, name)
        return value.decode() if value is not None else default

    async def state(self) -> str:
        return await self.field("state", "created")

    async def transition(self, action: str) -> str:
        """Apply `action` atomically; raises TransitionRefused (naming the state) when not allowed."""
        allowed, target = TRANSITIONS[action]
        done, state = await self._transition([self.keys.run], [target, now_ms(), *allowed])
        state = state.decode() if isinstance(state, bytes) else state
        if not done:
            raise TransitionRefused(action, state)
        log.info("event=run_state run=%s state=%s", self.settings.run_id, state)
        return state

    async def progress(self) -> dict[str, int]:
        """Train prompts submitted, trained (B per trainer step; the ledger lags until the trainer's
        next checkpoint), dropped as stale and dead (given up by the queue or by the trainer)."""
        g, k = self.settings.group_size, self.keys
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hget(k.run, "submitted").llen(k.trained).llen(k.dropped).hget(k.run, "dead_train")
            pipe.smembers(k.trained_dead)
            submitted, ledgered, dropped, dead, dead_groups = await pipe.execute()
        submitted = int(submitted or 0)
        trained = max(int(ledgered) // g, self.trainer_step * self.settings.batch_prompts)
        dead_groups = sum(1 for gid in dead_groups if self._train_index(gid.decode()) is not None)
        return {"submitted": submitted, "trained": trained, "dropped": int(dropped) // g,
                "dead": int(dead or 0) + dead_groups}

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
            self.trainer_version, self.trainer_step = status.version.version, status.step
            self.trainer_metrics = dict(status.last_metrics)
        except Exception as exc:  # noqa: BLE001 - restarting or finished: fall back to its ledger
            log.debug("event=trainer_unreachable error=%s", type(exc).__name__)
            steps = await self.redis.llen(self.keys.trained) // self.settings.group_size // self.settings.batch_prompts
            offset = self.trainer_version - self.trainer_step  # versions a restarted trainer numbered past steps
            self.trainer_step = max(self.trainer_step, steps)
            self.trainer_version = max(self.trainer_version, steps + offset)
        TRAINER_VERSION.set(self.trainer_version)
        TRAINER_STEP.set(self.trainer_step)

    async def sweep(self) -> None:
        requeued, dead = await self.queue.requeue_expired(self.settings.max_attempts)
        REQUEUED.inc(requeued)
        DEAD.inc(dead)

    async def count_dead(self) -> None:
        """Fold new entries of the task dead-letter stream into the count of dead train tasks (the
        cursor moves in the same transaction as the count)."""
        cursor = await self.field("dead_cursor", "0-0")
        reply = await self.redis.xread({self.keys.dead: cursor}, count=4096)
        if not reply:
            return
        entries = reply[0][1]
        submitted = int(await self.field("submitted", "0"))
        train = sum(1 for _, f in entries
                    if (i := self._train_index(f.get(b"task_id", b"").decode(errors="replace"))) is not None
                    and i < submitted)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hincrby(self.keys.run, "dead_train", train).hset(self.keys.run, "dead_cursor", entries[-1][0])
            await pipe.execute()

    def make_task(self, task_id: str, example: Example, group_size: int, temperature: float, is_eval: bool,
                  min_version: int) -> common_pb2.PromptTask:
        s = self.settings
        return common_pb2.PromptTask(
            task_id=task_id, run_id=s.run_id, group_id=task_id, task_name=self.reward,
            prompt_token_ids=encode_prompt(self.tokenizer, example.prompt), answer=example.answer,
            group_size=group_size, is_eval=is_eval, min_policy_version=min_version,
            sampling=common_pb2.SamplingParams(temperature=temperature, top_p=s.top_p if temperature else 1.0,
                                               max_new_tokens=s.max_new_tokens),
        )

    async def admit(self) -> int:
        """Queue train tasks up to the staleness budget; returns how many were queued."""
        s = self.settings
        p = await self.progress()
        outstanding = p["submitted"] - (p["trained"] + p["dropped"] + p["dead"])
        budget = (s.max_staleness + 1) * s.batch_prompts - outstanding
        if s.steps:
            budget = min(budget, s.steps * s.batch_prompts - p["trained"] - outstanding)
        OUTSTANDING.set(outstanding)
        if budget <= 0:
            return 0
        tasks = [self.make_task(f"train-{i}", self.train[i % len(self.train)], s.group_size, s.temperature, False,
                                self.trainer_version) for i in range(p["submitted"], p["submitted"] + budget)]
        submitted = p["submitted"] + len(tasks)
        await self.queue.submit_many(tasks, (self.keys.run, {"submitted": submitted,
                                                             "epoch": submitted // len(self.train)}))
        SUBMITTED.labels("train").inc(len(tasks))
        return len(tasks)

    def eval_steps(self) -> list[int]:
        s = self.settings
        if not s.eval_every:
            return []
        steps = list(range(0, (s.steps or self.trainer_step) + 1, s.eval_every))
        if s.steps and steps[-1] != s.steps:
            steps.append(s.steps)
        return steps

    async def schedule_evals(self) -> None:
        submitted = json.loads(await self.field("evals_submitted", "[]"))
        requested = json.loads(await self.field("eval_versions", "{}"))
        for step in [v for v in self.eval_steps() if v <= self.trainer_step and v not in submitted]:
            version = max(0, step + self.trainer_version - self.trainer_step)  # the version step `step` made
            tasks = [self.make_task(f"eval-{step}-{j}", example, 1, 0.0, True, version)
                     for j, example in enumerate(self.eval)]
            submitted.append(step)
            requested[str(step)] = version
            await self.queue.submit_many(tasks, (self.keys.run, {"evals_submitted": json.dumps(submitted),
                                                                 "eval_versions": json.dumps(requested)}))
            SUBMITTED.labels("eval").inc(len(tasks))
            log.info("event=eval_scheduled step=%d version=%d prompts=%d", step, version, len(tasks))

    async def collect_evals(self) -> None:
        """Fold eval rollouts into rounds; a complete round is appended to eval.jsonl once. An
        entry that fits no round (a foreign id, a broken payload) is counted and skipped."""
        reply = await self.redis.xread({self.keys.evals: self._eval_cursor}, count=4096)
        if not reply:
            return
        written = set(json.loads(await self.field("evals_written", "[]")))
        requested = json.loads(await self.field("eval_versions", "{}"))
        for entry_id, fields in reply[0][1]:
            self._eval_cursor = entry_id
            try:
                rollout = decode_rollout(fields.get(b"r", b""))
            except RolloutError as exc:
                self._refuse_eval(entry_id, exc.reason)
                continue
            match = EVAL_ID.match(rollout.task_id)
            if match is None or int(match.group(2)) >= len(self.eval):
                self._refuse_eval(entry_id, "unknown_eval_task")
                continue
            step = int(match.group(1))
            if step in written:
                continue
            bucket = self.eval_results.setdefault(step, {"n": 0, "correct": 0.0, "vmin": 1 << 62, "vmax": 0})
            bucket["n"] += 1
            bucket["correct"] += rollout.reward
            if len(rollout.policy_versions):
                bucket["vmin"] = min(bucket["vmin"], rollout.min_version)
                bucket["vmax"] = max(bucket["vmax"], int(rollout.policy_versions.max()))
        for step, bucket in sorted(self.eval_results.items()):
            if step in written or bucket["n"] < len(self.eval):
                continue
            line = {"step": step, "version": int(requested.get(str(step), step)),
                    "accuracy": bucket["correct"] / bucket["n"],
                    "prompts": bucket["n"], "policy_version_min": bucket["vmin"],
                    "policy_version_max": bucket["vmax"], "unix_ms": now_ms()}
            self.settings.out_dir.mkdir(parents=True, exist_ok=True)
            with (self.settings.out_dir / "eval.jsonl").open("a") as f:
                f.write(json.dumps(line) + "\n")
            written.add(step)
            EVAL_ACCURACY.set(line["accuracy"])
            log.info("event=eval step=%d version=%d accuracy=%.4f", step, line["version"], line["accuracy"])
        await self.redis.hset(self.keys.run, "evals_written", json.dumps(sorted(written)))

    def _refuse_eval(self, entry_id: bytes, reason: str) -> None:
        EVAL_REFUSED.labels(reason).inc()
        log.warning("event=eval_rollout_refused entry=%s reason=%s", entry_id.decode(), reason)

    async def finished(self) -> bool:
        s = self.settings
        if not s.steps or self.trainer_step < s.steps:
            return False
        written = set(json.loads(await self.field("evals_written", "[]")))
        return set(self.eval_steps()) <= written

    async def tick(self) -> None:
        state = await self.state()
        await self.refresh_trainer()
        await self.sweep()
        await self.count_dead()
        await self.collect_evals()
        if state == "running":
            await self.admit()
            await self.schedule_evals()
            if await self.finished():
                try:
                    await self.transition("finish")
                except TransitionRefused as exc:  # stopped or paused meanwhile: theirs is final
                    log.info("event=finish_refused state=%s", exc.state)
        depths = await self.queue.depths()
        for name in ("pending", "leased", "completed", "dead", "rollouts"):
            QUEUE_DEPTH.labels(name).set(getattr(depths, name))

    async def run(self, stop: asyncio.Event) -> None:
        created = await self.redis.hsetnx(self.keys.run, "created_unix_ms", now_ms())
        if created:
            await self.redis.hset(self.keys.run, "config", self.config_json())
        else:
            log.info("event=resumed run=%s state=%s progress=%s", self.settings.run_id, await self.state(),
                     await self.progress())
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
        return {
            "run_id": self.settings.run_id, "state": await self.state(), "trainer_version": self.trainer_version,
            "trainer_step": self.trainer_step, "replica_versions": replicas, "progress": await self.progress(),
            "queue": {"pending": depths.pending, "leased": depths.leased, "completed": depths.completed,
                      "dead": depths.dead, "rollouts": depths.rollouts},
            "dead_letters": {"tasks": await self.queue.dead_counts(),
                             "rollouts": {k.decode(): int(v) for k, v in
                                          (await self.redis.hgetall(self.keys.rollouts_dead_counts)).items()}},
            "epoch": int(await self.field("epoch", "0")),
            "staleness": {k: self.trainer_metrics[k] for k in ("staleness_mean", "staleness_max", "dropped_stale")
                          if k in self.trainer_metrics},
            "last_metrics": self.trainer_metrics,
            "evals": {str(v): b["correct"] / b["n"] for v, b in self.eval_results.items() if b["n"]},
        }

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
