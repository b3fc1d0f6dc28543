"""configs/tiny-judge.toml under `steadyrl run`, distilled too, with a judge pool and a teacher pool of two
replicas each, one of each SIGKILLed mid-run: the rollout replicas' Judge and Score calls go to the
other replica (a failed attempt each, bounded), the supervisor restarts the killed ones, the run
finishes, every step reports the judge's agreement with exact match, the teacher's gap and the KL from
its top 8, and every task is trained once (none dead)."""

import json
import os
import re
from pathlib import Path

import pytest

from tests.helpers import kill_mid_run

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
STEPS = 12
B = 8


def test_a_judge_and_a_teacher_replica_killed_mid_run_lose_nothing(tmp_path, quick_judge_dir, tiny_model_dir):
    out = tmp_path / "run"
    settings = [
        f'teacher.path="{tiny_model_dir}"',
        "teacher.replicas=2",
        "trainer.distill.coef=1.0",
        "trainer.distill.reward_weight=1.0",
        "trainer.distill.top_k=8",  # configs/tiny-distill.toml's loss on the teacher's top 8, over its mini-batches
        "trainer.mini_batches=2",
        "inference.teacher.timeout_seconds=5",
        f"run.steps={STEPS}",
        f"run.batch_prompts={B}",
        f'judge.path="{quick_judge_dir}"',
        "judge.replicas=2",
        "orchestrator.evals.every=0",
        "inference.judge.timeout_seconds=5",
        "inference.tasks.lease_seconds=5",
    ]
    run = kill_mid_run(ROOT / "configs" / "tiny-judge.toml", out, settings, 4, ["judge-0", "teacher-0"])
    stderr = run.stderr
    metrics = out / "trainer" / "metrics.jsonl"
    assert run.returncode == 0, stderr[-3000:]
    for name in ("judge-0", "teacher-0"):
        assert re.search(rf"event=service_restarted service={name}", stderr), stderr[-3000:]
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(1, STEPS + 1))
    assert all(0.0 <= x["judge_agreement"] <= 1.0 for x in lines)  # every rollout judged and compared
    assert all("+distill_top8" in x["recipe"] and x["teacher_gap"] == x["teacher_gap"] for x in lines)  # never NaN
    assert all(-1e-6 <= x["teacher_kl"] < 10.0 for x in lines), [x["teacher_kl"] for x in lines]  # read, finite
    failures = sum(x["reward_failures"] for x in lines) / STEPS
    assert failures < 0.5, failures  # the verdicts are read (an unreadable one would score 0 with its reason)
    progress = json.loads((out / "summary.json").read_text())["final_status"]["progress"]
    assert progress["trained"] == STEPS * B and progress["dead"] == 0, progress
    assert progress["submitted"] == progress["trained"] + progress["dropped"] + progress["filtered"], progress
    # the killed replica was called while down (its restart loads a model: many steps long), and the call went on
    logs = {n: (out / "logs" / n).read_text() for n in os.listdir(out / "logs")}
    for pool in ("judge", "teacher"):
        saw = [n for n, text in logs.items() if f"event=pool_call_failed pool={pool}" in text]
        assert saw and all(n.startswith("inference") for n in saw), (pool, saw)
