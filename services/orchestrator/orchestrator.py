"""The run's owner: turns the dataset into prompt tasks under a staleness budget, sweeps expired
leases, schedules greedy evaluations and records their accuracy.

Everything it needs to resume lives in Redis (`steadyrl:{run}:run`): a restarted orchestrator
counts what the trainer's ledger says was trained or dropped and what the dead-letter stream
holds, and continues with the next task number, so no task is lost or submitted twice.

Admission (AReaL-style): tasks outstanding (submitted, not yet trained, dropped or dead) stay
below (max_staleness + 1) × B prompts, and each task asks for at least the trainer's version at
submission, so no rollout is ever more than max_staleness versions behind when it is trained.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from prometheus_client import Counter, Gauge
from redis.asyncio import Redis

from services.orchestrator.config import OrchestratorSettings
from shared.models import load_tokenizer
from shared.models.loading import encode_prompt
from shared.queues import WorkQueue, now_ms
from shared.rollout import decode_rollout
from shared.rpc.steadyrl.v1 import common_pb2
from shared.tasks import ArithTask, Example, MathTask

log = logging.getLogger("steadyrl.orchestrator")

SUBMITTED = Counter("steadyrl_orchestrator_tasks_submitted_total", "Prompt tasks queued", ["kind"])
REQUEUED = Counter("steadyrl_orchestrator_tasks_requeued_total", "Tasks re-queued after a lease expired")
DEAD = Counter("steadyrl_orchestrator_tasks_dead_total", "Tasks given up after max_attempts")
OUTSTANDING = Gauge("steadyrl_orchestrator_outstanding_prompts", "Train prompts submitted and not yet done")
TRAINER_VERSION = Gauge("steadyrl_orchestrator_trainer_version", "Trainer version seen by admission")
QUEUE_DEPTH = Gauge("steadyrl_orchestrator_queue_depth", "Work queue", ["state"])
EVAL_ACCURACY = Gauge("steadyrl_orchestrator_eval_accuracy", "Greedy accuracy of the last eval round")

STATES = ("created", "running", "paused", "stopped", "finished")


def dataset(settings: OrchestratorSettings) -> tuple[list[Example], list[Example], str]:
    if settings.task == "arith":
        task = ArithTask(digits=settings.arith_digits, seed=settings.task_seed,
                         fixed_width=settings.arith_fixed_width, reverse=settings.arith_reverse)
        train = task.split("train", min(settings.train_size, task.max_split_size("train")))
        return train, task.split("eval", min(settings.eval_size, task.max_split_size("eval"))), "exact_match"
    if settings.math_path is None:
        raise ValueError("task 'math' needs math_path")
    task = MathTask(settings.math_path)
    return task.split("train", settings.train_size), task.split("eval", settings.eval_size), "math_verify"


class Orchestrator:
    def __init__(self, settings: OrchestratorSettings, redis: Redis) -> None:
        self.settings, self.redis = settings, redis
        self.queue = WorkQueue(redis, settings.run_id)
        prefix = f"steadyrl:{settings.run_id}:"
        self.run_key, self.replicas_key = prefix + "run", prefix + "replicas"
        self.ledger, self.dropped = prefix + "trained", prefix + "trained:dropped"
        self.train, self.eval, self.reward = dataset(settings)
        self.tokenizer = load_tokenizer(settings.model_path)
        self.trainer_version = 0
        self.trainer_metrics: dict[str, float] = {}
        self.eval_results: dict[int, dict[str, float]] = {}
        self._eval_cursor = "0-0"
        self._channel = self._trainer = None  # grpc.aio: made in the event loop, on first use

    # --- run state ------------------------------------------------------------------------------

    async def field(self, name: str, default: str = "") -> str:
        value = await self.redis.hget(self.run_key, name)
        return value.decode() if value is not None else default

    async def state(self) -> str:
        return await self.field("state", "created")

    async def set_state(self, state: str) -> None:
        if state not in STATES:
            raise ValueError(f"unknown state {state!r}")
        await self.redis.hset(self.run_key, mapping={"state": state, f"{state}_unix_ms": now_ms()})
        log.info("event=run_state run=%s state=%s", self.settings.run_id, state)

    async def progress(self) -> dict[str, int]:
        """Prompts submitted, trained (each version is B prompts; the ledger lags until the
        trainer's next checkpoint), dropped as stale and given up."""
        g = self.settings.group_size
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hget(self.run_key, "submitted").llen(self.ledger).llen(self.dropped).hget(self.run_key, "dead_train")
            submitted, ledgered, dropped, dead = await pipe.execute()
        trained = max(int(ledgered) // g, self.trainer_version * self.settings.batch_prompts)
        return {"submitted": int(submitted or 0), "trained": trained, "dropped": int(dropped) // g,
                "dead": int(dead or 0)}

    # --- one tick -------------------------------------------------------------------------------

    async def refresh_trainer_version(self) -> int:
        if self.settings.trainer_address and self._trainer is None:
            from shared.rpc import channel_options
            from shared.rpc.auth import channel
            from shared.rpc.steadyrl.v1 import trainer_pb2_grpc

            self._channel = channel(self.settings.trainer_address, options=channel_options())
            self._trainer = trainer_pb2_grpc.TrainerStub(self._channel)
        if self._trainer is not None:
            try:
                status = await self._trainer.Status(common_pb2.Empty(), timeout=2)
                self.trainer_version = status.version.version
                self.trainer_metrics = dict(status.last_metrics)
                TRAINER_VERSION.set(self.trainer_version)
                return self.trainer_version
            except Exception as exc:  # noqa: BLE001 - restarting or finished: fall back to its ledger
                log.debug("event=trainer_unreachable error=%s", type(exc).__name__)
        # the ledger says how many steps the trainer made, up to its last checkpoint
        ledgered = await self.redis.llen(self.ledger) // self.settings.group_size
        self.trainer_version = max(self.trainer_version, ledgered // self.settings.batch_prompts)
        TRAINER_VERSION.set(self.trainer_version)
        return self.trainer_version

    async def sweep(self) -> None:
        requeued, dead = await self.queue.requeue_expired(self.settings.max_attempts)
        REQUEUED.inc(requeued)
        if dead:
            DEAD.inc(dead)
            entries = await self.redis.xrevrange(self.queue.keys["dead"], count=dead)
            train_dead = sum(1 for _, f in entries if f[b"task_id"].startswith(b"train-"))
            if train_dead:
                await self.redis.hincrby(self.run_key, "dead_train", train_dead)

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
        done = p["trained"] + p["dropped"] + p["dead"]
        outstanding = p["submitted"] - done
        budget = (s.max_staleness + 1) * s.batch_prompts - outstanding
        if s.steps:
            budget = min(budget, s.steps * s.batch_prompts - p["trained"] - outstanding)
        OUTSTANDING.set(outstanding)
        if budget <= 0:
            return 0
        tasks = []
        for index in range(p["submitted"], p["submitted"] + budget):
            example = self.train[index % len(self.train)]
            tasks.append(self.make_task(f"train-{index}", example, s.group_size, s.temperature, False,
                                        self.trainer_version))
        submitted = p["submitted"] + len(tasks)
        await self.queue.submit_many(tasks, (self.run_key, {"submitted": submitted,
                                                            "epoch": submitted // len(self.train)}))
        SUBMITTED.labels("train").inc(len(tasks))
        return len(tasks)

    def eval_versions(self) -> list[int]:
        s = self.settings
        if not s.eval_every:
            return []
        versions = list(range(0, (s.steps or self.trainer_version) + 1, s.eval_every))
        if s.steps and versions[-1] != s.steps:
            versions.append(s.steps)
        return versions

    async def schedule_evals(self) -> None:
        submitted = json.loads(await self.field("evals_submitted", "[]"))
        due = [v for v in self.eval_versions() if v <= self.trainer_version and v not in submitted]
        for version in due:
            tasks = [self.make_task(f"eval-{version}-{j}", example, 1, 0.0, True, version)
                     for j, example in enumerate(self.eval)]
            submitted.append(version)
            await self.queue.submit_many(tasks, (self.run_key, {"evals_submitted": json.dumps(submitted)}))
            SUBMITTED.labels("eval").inc(len(tasks))
            log.info("event=eval_scheduled version=%d prompts=%d", version, len(tasks))

    async def collect_evals(self) -> None:
        """Fold eval rollouts into rounds; a complete round is appended to eval.jsonl once."""
        reply = await self.redis.xread({self.queue.keys["evals"]: self._eval_cursor}, count=4096)
        if not reply:
            return
        written = set(json.loads(await self.field("evals_written", "[]")))
        for entry_id, fields in reply[0][1]:
            self._eval_cursor = entry_id
            rollout = decode_rollout(fields[b"r"])
            version = int(rollout.task_id.split("-")[1])
            if version in written:
                continue
            bucket = self.eval_results.setdefault(version, {"n": 0, "correct": 0.0, "vmin": 1 << 62, "vmax": 0})
            bucket["n"] += 1
            bucket["correct"] += rollout.reward
            if len(rollout.policy_versions):
                bucket["vmin"] = min(bucket["vmin"], rollout.min_version)
                bucket["vmax"] = max(bucket["vmax"], int(rollout.policy_versions.max()))
        for version, bucket in sorted(self.eval_results.items()):
            if version in written or bucket["n"] < len(self.eval):
                continue
            line = {"version": version, "accuracy": bucket["correct"] / bucket["n"], "prompts": bucket["n"],
                    "policy_version_min": bucket["vmin"], "policy_version_max": bucket["vmax"],
                    "unix_ms": now_ms()}
            self.settings.out_dir.mkdir(parents=True, exist_ok=True)
            with (self.settings.out_dir / "eval.jsonl").open("a") as f:
                f.write(json.dumps(line) + "\n")
            written.add(version)
            EVAL_ACCURACY.set(line["accuracy"])
            log.info("event=eval version=%d accuracy=%.4f", version, line["accuracy"])
        await self.redis.hset(self.run_key, "evals_written", json.dumps(sorted(written)))

    async def finished(self) -> bool:
        s = self.settings
        if not s.steps or self.trainer_version < s.steps:
            return False
        written = set(json.loads(await self.field("evals_written", "[]")))
        return set(self.eval_versions()) <= written

    async def tick(self) -> None:
        state = await self.state()
        await self.refresh_trainer_version()
        await self.sweep()
        await self.collect_evals()
        if state == "running":
            await self.admit()
            await self.schedule_evals()
            if await self.finished():
                await self.set_state("finished")
        depths = await self.queue.depths()
        for name in ("pending", "leased", "completed", "dead", "rollouts"):
            QUEUE_DEPTH.labels(name).set(getattr(depths, name))

    async def run(self, stop: asyncio.Event) -> None:
        if not await self.redis.hexists(self.run_key, "state"):
            await self.redis.hset(self.run_key, mapping={"state": "created", "created_unix_ms": now_ms(),
                                                         "config": self.config_json()})
        else:
            log.info("event=resumed run=%s state=%s progress=%s", self.settings.run_id, await self.state(),
                     await self.progress())
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
        replicas = {k.decode(): int(v) for k, v in (await self.redis.hgetall(self.replicas_key)).items()}
        return {
            "run_id": self.settings.run_id, "state": await self.state(), "trainer_version": self.trainer_version,
            "replica_versions": replicas, "progress": await self.progress(),
            "queue": {"pending": depths.pending, "leased": depths.leased, "completed": depths.completed,
                      "dead": depths.dead, "rollouts": depths.rollouts},
            "epoch": int(await self.field("epoch", "0")),
            "staleness": {k: self.trainer_metrics[k] for k in ("staleness_mean", "staleness_max", "dropped_stale")
                          if k in self.trainer_metrics},
            "last_metrics": self.trainer_metrics,
            "evals": {str(v): b["correct"] / b["n"] for v, b in self.eval_results.items() if b["n"]},
        }

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
