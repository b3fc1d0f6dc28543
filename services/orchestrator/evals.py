"""Evaluation rounds: scheduled at step 0, every `eval_every` steps and at the end, on every eval
set (the task's held-out `main` set and the named `eval_sets`), greedy and, with `eval_samples`,
sampled; a round complete on every set is appended to eval.jsonl once (the run hash remembers which
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
# greedy: eval-STEP-J; sampled (k per prompt): evalk-STEP-J; a named set's: eval.NAME-STEP-J, evalk.NAME-STEP-J
EVAL_ID = re.compile(r"^eval(k?)(?:\.([a-z0-9_]+))?-(\d+)-(\d+)$")
EVAL_SUBMITTED = Counter("steadyrl_orchestrator_eval_tasks_submitted_total", "Eval prompt tasks queued")
EVAL_REFUSED = Counter("steadyrl_orchestrator_eval_rollouts_refused_total", "Eval rollouts that fit no eval round",
                       ["reason"])
EVAL_ACCURACY = Gauge("steadyrl_orchestrator_eval_accuracy", "Greedy accuracy of the last eval round, per eval set",
                      ["set"])


def eval_task_id(sampled: bool, name: str, step: int, index: int) -> str:
    return f"eval{'k' if sampled else ''}{'' if name == 'main' else '.' + name}-{step}-{index}"


def _bucket() -> dict:
    return {"n": 0, "correct": 0.0, "vmin": 1 << 62, "vmax": 0, "sampled": {}}


class EvalRounds:
    def __init__(self, settings: OrchestratorSettings, redis: Redis, queue: WorkQueue, tasks: Tasks) -> None:
        self.settings, self.redis, self.queue, self.tasks = settings, redis, queue, tasks
        self.keys = RunKeys(settings.run_id)
        self.results: dict[int, dict[str, dict]] = {}  # step → eval set → what came back
        self.scalars = ScalarLog(settings.out_dir / "tensorboard" if settings.tensorboard else None, settings.tracking,
                                 settings.run_id, "orchestrator", settings.out_dir, settings.model_dump(mode="json"))
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
            k, temperature = self.settings.eval_samples, self.settings.eval_temperature
            tasks = [self.tasks.make(eval_task_id(False, name, step, j), example, 1, 0.0, True, version)
                     for name, examples in self.tasks.evals.items() for j, example in enumerate(examples)]
            if k:
                tasks += [self.tasks.make(eval_task_id(True, name, step, j), example, k, temperature, True, version)
                          for name, examples in self.tasks.evals.items() for j, example in enumerate(examples)]
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
            name = match and (match.group(2) or "main")
            if match is None or name not in self.tasks.evals or int(match.group(4)) >= len(self.tasks.evals[name]) or (
                    match.group(1) and not self.settings.eval_samples):
                self._refuse(entry_id, "unknown_eval_task")
                continue
            step, prompt = int(match.group(3)), int(match.group(4))
            if step in written:
                continue
            self._add(self.results.setdefault(step, {}).setdefault(name, _bucket()), rollout,
                      prompt if match.group(1) else None)
        for step, buckets in sorted(self.results.items()):
            if step not in written and all(self._complete(buckets.get(name), len(examples))
                                           for name, examples in self.tasks.evals.items()):
                self._write(step, buckets, int(requested.get(str(step), step)))
                written.add(step)
        await self.redis.hset(self.keys.run, "evals_written", json.dumps(sorted(written)))

    @staticmethod
    def _add(bucket: dict, rollout, sampled_prompt: int | None) -> None:
        """One eval rollout into its set's bucket: a greedy answer, or one of the k samples of a prompt."""
        if sampled_prompt is not None:
            n, c = bucket["sampled"].get(sampled_prompt, (0, 0))
            bucket["sampled"][sampled_prompt] = (n + 1, c + (rollout.reward == 1.0))
        else:
            bucket["n"] += 1
            bucket["correct"] += rollout.reward
        if len(rollout.policy_versions):
            bucket["vmin"] = min(bucket["vmin"], rollout.min_version)
            bucket["vmax"] = max(bucket["vmax"], int(rollout.policy_versions.max()))

    def _write(self, step: int, buckets: dict[str, dict], version: int) -> None:
        """A round complete on every set: its eval.jsonl line, scalars, gauges and log line."""
        sets = {name: self._scores(buckets[name]) for name in self.tasks.evals}
        line = {"step": step, "version": version, **sets["main"],
                "policy_version_min": min(b["vmin"] for b in buckets.values()),
                "policy_version_max": max(b["vmax"] for b in buckets.values()), "unix_ms": now_ms()}
        if len(sets) > 1:
            line["sets"] = sets
        self.settings.out_dir.mkdir(parents=True, exist_ok=True)
        with (self.settings.out_dir / "eval.jsonl").open("a") as f:
            f.write(json.dumps(line) + "\n")
        scalars = {}
        for name, scores in sets.items():  # no key is another's prefix dir (MLflow's file store)
            prefix = "eval_" if name == "main" else f"eval_set/{name}/"
            scalars.update({prefix + key: scores[key] for key in ("accuracy", "pass_at_k", "mean_at_k") if key in scores})
            EVAL_ACCURACY.labels(name).set(scores["accuracy"])
        self.scalars.add(step, scalars)
        self.scalars.flush()
        log.info("event=eval step=%d version=%d accuracy=%.4f%s", step, version, line["accuracy"],
                 "".join(f" {n}={v['accuracy']:.4f}" for n, v in sets.items() if n != "main"))

    def _complete(self, bucket: dict | None, prompts: int) -> bool:
        k = self.settings.eval_samples
        return bucket is not None and bucket["n"] >= prompts and (
            not k or sum(n for n, _ in bucket["sampled"].values()) >= k * prompts)

    def _scores(self, bucket: dict) -> dict:
        out = {"accuracy": bucket["correct"] / bucket["n"], "prompts": bucket["n"]}
        if self.settings.eval_samples:
            k = self.settings.eval_samples
            out.update(k=k, **sampled_scores(list(bucket["sampled"].values()), k))
        return out

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
        return {str(v): b["main"]["correct"] / b["main"]["n"] for v, b in self.results.items()
                if b.get("main", {}).get("n")}
