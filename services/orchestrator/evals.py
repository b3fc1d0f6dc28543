"""Greedy evaluation rounds: scheduled at step 0, every `eval_every` steps and at the end, on the
held-out eval set; a complete round is appended to eval.jsonl once (the run hash remembers which
rounds were submitted and written, so a restarted orchestrator neither repeats nor loses one)."""

from __future__ import annotations

import json
import logging
import re

from prometheus_client import Counter, Gauge
from redis.asyncio import Redis

from services.orchestrator.config import OrchestratorSettings
from services.orchestrator.data import Tasks
from shared.core.evals import sampled_scores
from shared.keys import RunKeys
from shared.queues import WorkQueue, now_ms
from shared.rollout import RolloutError, decode_rollout
from shared.tracking import ScalarLog

log = logging.getLogger("steadyrl.orchestrator")
EVAL_ID = re.compile(r"^eval(k?)-(\d+)-(\d+)$")  # greedy: eval-STEP-J; sampled (k per prompt): evalk-STEP-J
EVAL_SUBMITTED = Counter("steadyrl_orchestrator_eval_tasks_submitted_total", "Eval prompt tasks queued")
EVAL_REFUSED = Counter("steadyrl_orchestrator_eval_rollouts_refused_total", "Eval rollouts that fit no eval round",
                       ["reason"])
EVAL_ACCURACY = Gauge("steadyrl_orchestrator_eval_accuracy", "Greedy accuracy of the last eval round")


class EvalRounds:
    def __init__(self, settings: OrchestratorSettings, redis: Redis, queue: WorkQueue, tasks: Tasks) -> None:
        self.settings, self.redis, self.queue, self.tasks = settings, redis, queue, tasks
        self.keys = RunKeys(settings.run_id)
        self.results: dict[int, dict[str, float]] = {}
        self.scalars = ScalarLog(settings.out_dir / "tensorboard" if settings.tensorboard else None)
        self.cursor = "0-0"

    async def _json(self, name: str, default: str):
        value = await self.redis.hget(self.keys.run, name)
        return json.loads(value.decode() if value is not None else default)

    def steps(self, trainer_step: int) -> list[int]:
        s = self.settings
        if not s.eval_every:
            return []
        steps = list(range(0, (s.steps or trainer_step) + 1, s.eval_every))
        if s.steps and steps[-1] != s.steps:
            steps.append(s.steps)
        return steps

    async def schedule(self, trainer_step: int, trainer_version: int) -> None:
        submitted = await self._json("evals_submitted", "[]")
        requested = await self._json("eval_versions", "{}")
        for step in [v for v in self.steps(trainer_step) if v <= trainer_step and v not in submitted]:
            version = max(0, step + trainer_version - trainer_step)  # the version step `step` made
            tasks = [self.tasks.make(f"eval-{step}-{j}", example, 1, 0.0, True, version)
                     for j, example in enumerate(self.tasks.eval)]
            if self.settings.eval_samples:
                tasks += [self.tasks.make(f"evalk-{step}-{j}", example, self.settings.eval_samples,
                                          self.settings.eval_temperature, True, version)
                          for j, example in enumerate(self.tasks.eval)]
            submitted.append(step)
            requested[str(step)] = version
            await self.queue.submit_many(tasks, (self.keys.run, {"evals_submitted": json.dumps(submitted),
                                                                 "eval_versions": json.dumps(requested)}))
            EVAL_SUBMITTED.inc(len(tasks))
            log.info("event=eval_scheduled step=%d version=%d prompts=%d", step, version, len(tasks))

    async def collect(self) -> None:
        """Fold eval rollouts into rounds; a complete round is appended to eval.jsonl once. An
        entry that fits no round (a foreign id, a broken payload) is counted and skipped."""
        reply = await self.redis.xread({self.keys.evals: self.cursor}, count=4096)
        if not reply:
            return
        written = set(await self._json("evals_written", "[]"))
        requested = await self._json("eval_versions", "{}")
        for entry_id, fields in reply[0][1]:
            self.cursor = entry_id
            try:
                rollout = decode_rollout(fields.get(b"r", b""))
            except RolloutError as exc:
                self._refuse(entry_id, exc.reason)
                continue
            match = EVAL_ID.match(rollout.task_id)
            if match is None or int(match.group(3)) >= len(self.tasks.eval) or (
                    match.group(1) and not self.settings.eval_samples):
                self._refuse(entry_id, "unknown_eval_task")
                continue
            step, prompt = int(match.group(2)), int(match.group(3))
            if step in written:
                continue
            bucket = self.results.setdefault(step, {"n": 0, "correct": 0.0, "vmin": 1 << 62, "vmax": 0,
                                                    "sampled": {}})
            if match.group(1):  # one of the k samples of prompt `prompt`
                n, c = bucket["sampled"].get(prompt, (0, 0))
                bucket["sampled"][prompt] = (n + 1, c + (rollout.reward == 1.0))
            else:
                bucket["n"] += 1
                bucket["correct"] += rollout.reward
            if len(rollout.policy_versions):
                bucket["vmin"] = min(bucket["vmin"], rollout.min_version)
                bucket["vmax"] = max(bucket["vmax"], int(rollout.policy_versions.max()))
        k = self.settings.eval_samples
        for step, bucket in sorted(self.results.items()):
            if step in written or bucket["n"] < len(self.tasks.eval) or (
                    k and sum(n for n, _ in bucket["sampled"].values()) < k * len(self.tasks.eval)):
                continue
            line = {"step": step, "version": int(requested.get(str(step), step)),
                    "accuracy": bucket["correct"] / bucket["n"], "prompts": bucket["n"],
                    "policy_version_min": bucket["vmin"], "policy_version_max": bucket["vmax"], "unix_ms": now_ms()}
            if k:
                line.update(k=k, **sampled_scores(list(bucket["sampled"].values()), k))
            self.settings.out_dir.mkdir(parents=True, exist_ok=True)
            with (self.settings.out_dir / "eval.jsonl").open("a") as f:
                f.write(json.dumps(line) + "\n")
            written.add(step)
            self.scalars.add(step, {"eval_accuracy": line["accuracy"],
                                    **({"eval_pass_at_k": line["pass_at_k"], "eval_mean_at_k": line["mean_at_k"]}
                                       if k else {})})
            self.scalars.flush()
            EVAL_ACCURACY.set(line["accuracy"])
            log.info("event=eval step=%d version=%d accuracy=%.4f", step, line["version"], line["accuracy"])
        await self.redis.hset(self.keys.run, "evals_written", json.dumps(sorted(written)))

    def _refuse(self, entry_id: bytes, reason: str) -> None:
        EVAL_REFUSED.labels(reason).inc()
        log.warning("event=eval_rollout_refused entry=%s reason=%s", entry_id.decode(), reason)

    async def baseline_written(self) -> bool:
        """Whether the step-0 round (the cold start) is in, or there is none: training waits for it,
        else versions that land while it generates would be scored as version 0."""
        return not self.settings.eval_every or 0 in await self._json("evals_written", "[]")

    async def all_written(self, trainer_step: int) -> bool:
        return set(self.steps(trainer_step)) <= set(await self._json("evals_written", "[]"))

    def accuracies(self) -> dict[str, float]:
        return {str(v): b["correct"] / b["n"] for v, b in self.results.items() if b["n"]}
