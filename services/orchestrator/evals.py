"""Evaluation rounds: at step 0, every `evals.every` steps and at the end, on every eval set (the task's `main`, a
data mixture's sources' and the named `evals.sets`, each problem scored by its source's reward), greedy and, with
`evals.samples`, sampled; each complete round is appended to eval.jsonl once, across restarts too. They score μ, the
served model. With `policy_eval` every round also scores π (the trainer's published weights, unquantised) greedily
on the `policy_eval` pool (`shared.runstore.queues.POOLS`), appended to policy-eval.jsonl, so an alert can compare π
with where it started.

Details: docs/internals/orchestrator.md"""

from __future__ import annotations

import json
import logging
import re

from prometheus_client import Counter, Gauge
from redis.asyncio import Redis

from services.orchestrator.config import OrchestratorSettings
from services.orchestrator.data import Tasks
from shared.core.evals import sampled_scores
from shared.rollouts.record import RolloutError, decode_rollout
from shared.runstore.keys import RunField, RunKeys
from shared.runstore.queues import POLICY_EVAL_PREFIX, WorkQueue, given_up, now_ms
from shared.runtime.tracking import ScalarLog

log = logging.getLogger("steadyrl.orchestrator")
# μ greedy: eval-STEP-J; μ sampled (k per prompt): evalk-STEP-J; π greedy: evalpi-STEP-J;
# a named set's: eval.NAME-STEP-J, evalk.NAME-STEP-J, evalpi.NAME-STEP-J
KINDS = ("", "k", POLICY_EVAL_PREFIX.removeprefix("eval"))  # the queue routes π's tasks by their prefix
EVAL_ID = re.compile(rf"^eval({'|'.join(k for k in KINDS if k)})?(?:\.([a-z0-9_]+))?-(\d+)-(\d+)$")
EVAL_SUBMITTED = Counter("steadyrl_orchestrator_eval_tasks_submitted_total", "Eval prompt tasks queued")
EVAL_REFUSED = Counter(
    "steadyrl_orchestrator_eval_rollouts_refused_total", "Eval rollouts that fit no eval round", ["reason"]
)
EVAL_ACCURACY = Gauge(
    "steadyrl_orchestrator_eval_accuracy", "Greedy accuracy of the last eval round, per eval set", ["set"]
)
POLICY_EVAL_ACCURACY = Gauge(
    "steadyrl_orchestrator_policy_eval_accuracy",
    "Greedy accuracy of the trainer's weights (π, unquantised) in the last eval round, per eval set",
    ["set"],
)
POLICY_EVAL_PREVIOUS = Gauge(
    "steadyrl_orchestrator_policy_eval_previous_accuracy",
    "Greedy accuracy of π in the round before the last, per eval set (SteadyrlPolicyUnderStart "
    "needs two rounds in a row under the start)",
    ["set"],
)
POLICY_EVAL_INITIAL = Gauge(
    "steadyrl_orchestrator_policy_eval_initial_accuracy",
    "Greedy accuracy of π in the run's first eval round (version 0), per eval set",
    ["set"],
)


def eval_task_id(kind: str, name: str, step: int, index: int) -> str:
    """The id of eval task `index` of set `name` in the round of `step`; kind: "" (μ greedy), "k" (μ
    sampled) or "pi" (π greedy)."""
    if kind not in KINDS:
        raise ValueError(f"eval kind must be one of {KINDS}, got {kind!r}")
    return f"eval{kind}{'' if name == 'main' else '.' + name}-{step}-{index}"


def _bucket() -> dict:
    # dead: greedy prompts whose task was given up (the dead-letter stream), dead_sampled: sampled ones
    return {"n": 0, "correct": 0.0, "vmin": 1 << 62, "vmax": 0, "sampled": {}, "dead": set(), "dead_sampled": set()}


class EvalRounds:
    def __init__(self, settings: OrchestratorSettings, redis: Redis, queue: WorkQueue, tasks: Tasks) -> None:
        self.settings = settings
        self.redis = redis
        self.queue = queue
        self.tasks = tasks
        self.keys = RunKeys(settings.run_id)
        self.results: dict[int, dict[str, dict]] = {}  # step → eval set → what came back (μ)
        self.policy_results: dict[int, dict[str, dict]] = {}  # the same for π
        self.scalars = ScalarLog(
            settings.out_dir / "tensorboard" if settings.tensorboard else None,
            settings.tracking,
            settings.run_id,
            "orchestrator",
            settings.out_dir,
            settings.model_dump(mode="json"),
        )
        self.cursor = self.dead_cursor = "0-0"

    async def _json(self, name: str, default: str):
        (value,) = await self._jsons((name, default))
        return value

    async def _jsons(self, *fields: tuple[str, str]) -> list:
        """JSON fields of the run hash in one read, each its default where it is absent."""
        values = await self.redis.hmget(self.keys.run, [name for name, _ in fields])
        return [json.loads(v.decode() if v is not None else d) for v, (_, d) in zip(values, fields, strict=True)]

    def steps(self, trainer_step: int) -> list[int]:
        s = self.settings
        if not s.evals.every:
            return []
        steps = list(range(0, (s.steps or trainer_step) + 1, s.evals.every))
        if s.steps and steps[-1] != s.steps:
            steps.append(s.steps)
        return steps

    async def schedule(self, trainer_step: int, trainer_version: int) -> None:
        submitted, requested = await self._jsons((RunField.EVALS_SUBMITTED, "[]"), (RunField.EVAL_VERSIONS, "{}"))
        for step in [v for v in self.steps(trainer_step) if v <= trainer_step and v not in submitted]:
            version = max(0, step + trainer_version - trainer_step)  # the version step `step` made
            k = self.settings.evals.samples
            temperature = self.settings.evals.temperature
            rounds = (
                [("", 1, 0.0)]
                + ([("k", k, temperature)] if k else [])
                + ([("pi", 1, 0.0)] if self.settings.evals.policy else [])
            )
            self.tasks.encode([(source, e.prompt) for problems in self.tasks.evals.values() for source, e in problems])
            tasks = [
                self.tasks.make(eval_task_id(kind, name, step, j), example, group, t, True, version, source)
                for kind, group, t in rounds
                for name, problems in self.tasks.evals.items()
                for j, (source, example) in enumerate(problems)
            ]
            submitted.append(step)
            requested[str(step)] = version
            await self.queue.submit_many(
                tasks,
                (
                    self.keys.run,
                    {RunField.EVALS_SUBMITTED: json.dumps(submitted), RunField.EVAL_VERSIONS: json.dumps(requested)},
                ),
            )
            EVAL_SUBMITTED.inc(len(tasks))
            log.info("event=eval_scheduled step=%d version=%d prompts=%d", step, version, len(tasks))

    async def collect(self) -> None:
        """Fold eval rollouts into rounds; a complete round is appended to eval.jsonl (π's to
        policy-eval.jsonl) once. An entry that fits no round (a foreign id, a broken payload) is
        counted and skipped. An eval task given up (the dead-letter stream) completes its round as
        a prompt without an answer, counted under `dead`: a round never waits for it, nor the run's end."""
        dead = await self._fold_dead()
        reply = await self.redis.xread({self.keys.evals: self.cursor}, count=4096)
        if not reply and not dead:
            return
        written, policy_written, requested, submitted = await self._jsons(
            (RunField.EVALS_WRITTEN, "[]"),
            (RunField.POLICY_EVALS_WRITTEN, "[]"),
            (RunField.EVAL_VERSIONS, "{}"),
            (RunField.EVALS_SUBMITTED, "[]"),
        )
        written, policy_written = set(written), set(policy_written)
        for entry_id, fields in reply[0][1] if reply else []:
            self.cursor = entry_id
            try:
                rollout = decode_rollout(fields.get(b"r", b""))
            except RolloutError as exc:
                self._refuse(entry_id, exc.reason)
                continue
            place = self._place(rollout.task_id)
            if place is None:
                self._refuse(entry_id, "unknown_eval_task")
                continue
            kind, name, step, prompt = place
            results, done = (self.policy_results, policy_written) if kind == "pi" else (self.results, written)
            if step in done:
                continue
            self._add(
                results.setdefault(step, {}).setdefault(name, _bucket()), rollout, prompt if kind == "k" else None
            )
        for policy, results, done in ((False, self.results, written), (True, self.policy_results, policy_written)):
            # in step order: a round that completes before an earlier one waits for it (a replica leases a
            # round's one-sample prompts a batch at a time, so rounds can finish out of order)
            for step in sorted(set(submitted) | set(results)):
                if step in done:
                    continue
                buckets = results.get(step, {})
                if not all(
                    self._complete(buckets.get(name), len(examples), policy)
                    for name, examples in self.tasks.evals.items()
                ):
                    break
                await self._write(step, buckets, int(requested.get(str(step), step)), policy)
                done.add(step)
        await self.redis.hset(
            self.keys.run,
            mapping={
                RunField.EVALS_WRITTEN: json.dumps(sorted(written)),
                RunField.POLICY_EVALS_WRITTEN: json.dumps(sorted(policy_written)),
            },
        )

    def _place(self, task_id: str) -> tuple[str, str, int, int] | None:
        """(kind, eval set, step, prompt) of an eval task of this run, None for any other id."""
        match = EVAL_ID.match(task_id)
        if match is None:
            return None
        kind = match.group(1) or ""
        name = match.group(2) or "main"
        step = int(match.group(3))
        prompt = int(match.group(4))
        if (
            name not in self.tasks.evals
            or prompt >= len(self.tasks.evals[name])
            or (kind == "k" and not self.settings.evals.samples)
            or (kind == "pi" and not self.settings.evals.policy)
        ):
            return None
        return kind, name, step, prompt

    async def _fold_dead(self) -> int:
        """Eval tasks given up since the last call (the dead-letter stream, read from its start by a
        new orchestrator, as the evals stream is) into their rounds; returns how many."""
        reply = await self.redis.xread({self.keys.dead: self.dead_cursor}, count=4096)
        folded = 0
        for entry_id, fields in reply[0][1] if reply else []:
            self.dead_cursor = entry_id
            task_id = fields.get(b"task_id", b"").decode(errors="replace")
            place = self._place(task_id)
            if place is None or not given_up(fields):
                continue
            kind, name, step, prompt = place
            bucket = (
                (self.policy_results if kind == "pi" else self.results).setdefault(step, {}).setdefault(name, _bucket())
            )
            bucket["dead_sampled" if kind == "k" else "dead"].add(prompt)
            folded += 1
            log.warning(
                "event=eval_task_dead task=%s reason=%s",
                task_id,
                fields.get(b"reason", b"").decode(errors="replace")[:300],
            )
        return folded

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

    async def _write(self, step: int, buckets: dict[str, dict], version: int, policy: bool) -> None:
        """A round complete on every set: its line in eval.jsonl (π's: policy-eval.jsonl), scalars,
        gauges and log line. π's first round is also kept in the run hash, its initial accuracy."""
        sets = {name: self._scores(buckets[name], policy) for name in self.tasks.evals}
        line = {
            "step": step,
            "version": version,
            **sets["main"],
            "policy_version_min": min(b["vmin"] for b in buckets.values()),
            "policy_version_max": max(b["vmax"] for b in buckets.values()),
            "unix_ms": now_ms(),
        }
        if len(sets) > 1:
            line["sets"] = sets
        self.settings.out_dir.mkdir(parents=True, exist_ok=True)
        with (self.settings.out_dir / ("policy-eval.jsonl" if policy else "eval.jsonl")).open("a") as f:
            f.write(json.dumps(line) + "\n")
        scalars = {}
        for name, scores in sets.items():  # no key is another's prefix dir (MLflow's file store)
            prefix = ("policy_eval" if policy else "eval") + ("_" if name == "main" else f"_set/{name}/")
            scalars.update(
                {prefix + key: scores[key] for key in ("accuracy", "pass_at_k", "mean_at_k") if key in scores}
            )
            if scores["prompts"] and not policy:  # a set whose every prompt was given up has no accuracy to show
                EVAL_ACCURACY.labels(name).set(scores["accuracy"])
        if policy:
            await self._keep_policy_round(step, sets)
        self.scalars.add(step, scalars)
        self.scalars.flush()
        log.info(
            "event=%s step=%d version=%d accuracy=%.4f%s",
            "policy_eval" if policy else "eval",
            step,
            version,
            line["accuracy"],
            "".join(f" {n}={v['accuracy']:.4f}" for n, v in sets.items() if n != "main"),
        )

    async def _keep_policy_round(self, step: int, sets: dict[str, dict]) -> None:
        """π's round in the run hash and the gauges: the first round (`policy_eval_initial`) and the
        two latest by step of each set (`policy_eval_recent`: the last and the one before, which the
        alert compares with the first so that one round's dip does not fire it)."""
        accuracies = {name: scores["accuracy"] for name, scores in sets.items() if scores["prompts"]}
        if step == 0:
            await self.redis.hset(self.keys.run, RunField.POLICY_EVAL_INITIAL, json.dumps(accuracies))
            self._set_initial(accuracies)
        recent = await self._json(RunField.POLICY_EVAL_RECENT, "{}")
        for name, accuracy in accuracies.items():
            rounds = {int(k): v for k, v in recent.get(name, {}).items()} | {step: accuracy}
            recent[name] = dict(sorted(rounds.items())[-2:])
        await self.redis.hset(self.keys.run, RunField.POLICY_EVAL_RECENT, json.dumps(recent))
        self._set_recent(recent)

    @staticmethod
    def _set_initial(initial: dict[str, float]) -> None:
        for name, accuracy in initial.items():
            POLICY_EVAL_INITIAL.labels(name).set(accuracy)

    @staticmethod
    def _set_recent(recent: dict[str, dict]) -> None:
        """Per set, its two latest rounds with an answered prompt (step → accuracy)."""
        for name, rounds in recent.items():
            latest = [rounds[step] for step in sorted(rounds, key=int)][::-1]
            for gauge, accuracy in zip((POLICY_EVAL_ACCURACY, POLICY_EVAL_PREVIOUS), latest, strict=False):
                gauge.labels(name).set(accuracy)

    async def restore(self) -> None:
        """A restarted orchestrator exports π's first and two latest rounds again (from the run hash)."""
        self._set_initial(await self._json(RunField.POLICY_EVAL_INITIAL, "{}"))
        self._set_recent(await self._json(RunField.POLICY_EVAL_RECENT, "{}"))

    def _complete(self, bucket: dict | None, prompts: int, policy: bool = False) -> bool:
        k = 0 if policy else self.settings.evals.samples  # π's rounds are greedy only
        return (
            bucket is not None
            and bucket["n"] + len(bucket["dead"]) >= prompts
            and (
                not k or sum(n for n, _ in bucket["sampled"].values()) + k * len(bucket["dead_sampled"]) >= k * prompts
            )
        )

    def _scores(self, bucket: dict, policy: bool = False) -> dict:
        """Accuracy over the prompts answered (`prompts`); prompts given up are counted under `dead`."""
        out = {"accuracy": bucket["correct"] / bucket["n"] if bucket["n"] else 0.0, "prompts": bucket["n"]}
        if bucket["dead"] or bucket["dead_sampled"]:
            out["dead"] = len(bucket["dead"]) + len(bucket["dead_sampled"])
        if self.settings.evals.samples and not policy and bucket["sampled"]:
            k = self.settings.evals.samples
            out.update(k=k, **sampled_scores(list(bucket["sampled"].values()), k))
        return out

    def _refuse(self, entry_id: bytes, reason: str) -> None:
        EVAL_REFUSED.labels(reason).inc()
        log.warning("event=eval_rollout_refused entry=%s reason=%s", entry_id.decode(), reason)

    def _written_fields(self) -> tuple[str, ...]:
        return (
            (RunField.EVALS_WRITTEN, RunField.POLICY_EVALS_WRITTEN)
            if self.settings.evals.policy
            else (RunField.EVALS_WRITTEN,)
        )

    async def baseline_written(self) -> bool:
        """Whether the step-0 round (the cold start; μ's and, with policy_eval, π's) is in, or there
        is none: training waits for it, else versions that land while it generates would be scored
        as version 0."""
        return not self.settings.evals.every or {0} <= await self._written()

    async def all_written(self, trainer_step: int) -> bool:
        return set(self.steps(trainer_step)) <= await self._written()

    async def _written(self) -> set[int]:
        """The rounds written for every model scored (μ, and π with policy_eval)."""
        written = await self._jsons(*((name, "[]") for name in self._written_fields()))
        return set.intersection(*map(set, written))

    def accuracies(self, policy: bool = False) -> dict[str, float]:
        """The main set's accuracy of each round so far (μ's, or π's) by step."""
        return {
            str(v): b["main"]["correct"] / b["main"]["n"]
            for v, b in (self.policy_results if policy else self.results).items()
            if b.get("main", {}).get("n")
        }
