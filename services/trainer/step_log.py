"""What each step leaves behind: a line in metrics.jsonl, the same keys as TensorBoard scalars
(`tensorboard/` beside it) and in W&B / MLflow when tracking names them, and the trainer's
Prometheus metrics."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from prometheus_client import Counter, Gauge, Histogram

from services.trainer.config import TrainerSettings
from shared.runtime.tracking import ScalarLog

STEPS = Counter("steadyrl_trainer_steps_total", "Global steps trained")
VERSION = Gauge("steadyrl_trainer_policy_version", "Policy version after the last step")
TRAINED = Counter("steadyrl_trainer_rollouts_trained_total", "Rollouts trained")
LAST_STEP = Gauge("steadyrl_trainer_last_step_unix_seconds", "When the last global step finished")
STEP_SECONDS = Histogram(
    "steadyrl_trainer_step_seconds",
    "Seconds per global step",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
LAST = Gauge("steadyrl_trainer_last_metric", "The last step's diagnostics", ["name"])
MAX_STALENESS = Gauge(
    "steadyrl_trainer_max_staleness",
    "The run's max_staleness: SteadyrlStalenessOverBudget fires when staleness_peak exceeds it",
)
STALL_AFTER = Gauge(
    "steadyrl_trainer_stall_alert_seconds",
    "Seconds without a finished step after which SteadyrlTrainerStalled fires (trainer.stall_alert_seconds)",
)


def reward_metrics(rollouts) -> dict[str, float]:
    """The share of a step's rollouts whose reward could not score them after its retries
    (`reward_failures`: left out of the loss; the orchestrator's stop rules fail a run where this
    stays high), and per data mixture source among them its rollouts and the mean of the rewards
    that scored (`source/NAME/rollouts`, `source/NAME/reward_mean`; none in a run of one source).
    Judged rollouts compared with a rule (`compare_with`) give `judge_agreement` (the share where
    the judge's reward and the rule's both are ≥ 0.5 or both below) and `judge_reference_reward_mean`."""
    out = {"reward_failures": sum(bool(r.reward_error) for r in rollouts) / max(len(rollouts), 1)}
    compared = [r for r in rollouts if r.reference_reward is not None and not r.reward_error]
    if compared:
        agree = sum((r.reward >= 0.5) == (r.reference_reward >= 0.5) for r in compared)
        out["judge_agreement"] = agree / len(compared)
        out["judge_reference_reward_mean"] = sum(r.reference_reward for r in compared) / len(compared)
    for name in sorted({r.source for r in rollouts if r.source}):
        rewards = [r.reward for r in rollouts if r.source == name and not r.reward_error]
        out[f"source/{name}/reward_mean"] = sum(rewards) / max(len(rewards), 1)
        out[f"source/{name}/rollouts"] = sum(r.source == name for r in rollouts)
    return out


def trajectory_metrics(rollouts) -> dict[str, float]:
    """A step's multi-turn diagnostics over its trajectories (none when it has none): model turns
    (`turns_mean`), model tokens per turn, the share of completion tokens the environment wrote,
    the share that ended done (not cut by a budget), and each environment count's mean per
    trajectory (`env_<name>`, 0 where a trajectory has none)."""
    multi = [r for r in rollouts if r.turns]
    if not multi:
        return {}
    model = sum(int(r.model_tokens.sum()) for r in multi)
    out = {
        "turns_mean": sum(r.turns for r in multi) / len(multi),
        "turn_tokens_mean": model / sum(r.turns for r in multi),
        "env_tokens_fraction": 1 - model / sum(len(r.completion_token_ids) for r in multi),
        "trajectories_done": sum(r.finish_reason == "done" for r in multi) / len(multi),
    }
    for key in sorted({k for r in multi for k in r.env_metrics}):
        out[f"env_{key}"] = sum(r.env_metrics.get(key, 0.0) for r in multi) / len(multi)
    return out


class StepLog:
    def __init__(self, settings: TrainerSettings) -> None:
        self.out_dir = out_dir = settings.out_dir
        LAST_STEP.set(time.time())  # the process start counts as progress: no stall alert before a first step
        STALL_AFTER.set(settings.stall_alert_seconds)
        MAX_STALENESS.set(settings.max_staleness)
        tensorboard = out_dir / "tensorboard" if settings.tensorboard else None
        config = settings.model_dump(mode="json")  # what the tracking backends record of the run
        self.scalars = ScalarLog(tensorboard, settings.tracking, settings.run_id, "trainer", out_dir, config)

    @property
    def path(self) -> Path:
        return self.out_dir / "metrics.jsonl"

    def resume(self, step: int) -> None:
        """metrics.jsonl as of the checkpoint the trainer resumes from: one line per step up to
        `step`. Lines of steps past it (trained, then lost with the crash: they are trained again)
        and a line cut short by the crash are dropped; a step's last line is the one kept."""
        if not self.path.exists():
            return
        kept: dict[int, str] = {}
        for line in self.path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
                kept[record["step"]] = line
        tmp = self.path.with_suffix(f".jsonl.{os.getpid()}.tmp")
        tmp.write_text("".join(kept[s] + "\n" for s in sorted(kept)))
        os.replace(tmp, self.path)

    def record(self, metrics: dict[str, float], rollouts: int, recipe: str) -> None:
        """The step's line (written and closed before this returns), its scalars and gauges."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(
                json.dumps(
                    {k: (round(v, 8) if isinstance(v, float) else v) for k, v in metrics.items()}
                    | {"recipe": recipe, "unix_ms": int(time.time() * 1000)}
                )
                + "\n"
            )
        self.scalars.add(int(metrics["step"]), metrics)
        STEPS.inc()
        TRAINED.inc(rollouts)
        STEP_SECONDS.observe(metrics["step_seconds"])
        VERSION.set(metrics["version"])
        LAST_STEP.set(time.time())
        for key, value in metrics.items():
            LAST.labels(key).set(value)

    def close(self) -> None:
        self.scalars.close()
