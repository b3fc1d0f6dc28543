"""configs/tiny-judge.toml under `steadyrl run` with a judge pool of two replicas, one SIGKILLed mid-run:
the rollout replicas' Judge calls go to the other (a failed attempt each, bounded), the supervisor
restarts the killed one, the run finishes, every step reports the judge's agreement with exact match,
and every task is trained once (none dead)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
STEPS = 16
B = 8


def test_a_judge_replica_killed_mid_run_loses_nothing(tmp_path, quick_judge_dir):
    out = tmp_path / "run"
    settings = [
        f"run.steps={STEPS}",
        f"run.batch_prompts={B}",
        f'judge.path="{quick_judge_dir}"',
        "judge.replicas=2",
        "orchestrator.evals.every=0",
        "inference.judge.timeout_seconds=5",
        "inference.tasks.lease_seconds=5",
    ]
    run = subprocess.Popen(
        [sys.executable, "-m", "steadyrl.cli", "run", str(ROOT / "configs" / "tiny-judge.toml")]
        + ["--out", str(out), "--progress", "none", *(a for s in settings for a in ("--set", s))],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = out / "trainer" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    try:
        while not metrics.exists() or len(metrics.read_text().splitlines()) < 4:
            assert run.poll() is None and time.monotonic() < deadline, run.stderr.read() if run.poll() else ""
            time.sleep(0.05)
        os.kill(json.loads((out / "pids.json").read_text())["judge-0"], signal.SIGKILL)
        stdout, stderr = run.communicate(timeout=600)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, stderr[-3000:]
    assert re.search(r"event=service_restarted service=judge-0", stderr), stderr[-3000:]
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(1, STEPS + 1))
    assert all(0.0 <= x["judge_agreement"] <= 1.0 for x in lines)  # every rollout judged and compared
    failures = sum(x["reward_failures"] for x in lines) / STEPS
    assert failures < 0.5, failures  # the verdicts are read (an unreadable one would score 0 with its reason)
    progress = json.loads((out / "summary.json").read_text())["final_status"]["progress"]
    assert progress["trained"] == STEPS * B and progress["dead"] == 0, progress
    assert progress["submitted"] == progress["trained"] + progress["dropped"] + progress["filtered"], progress
    # the killed replica was called while down (its restart loads a model: many steps long), and the call went on
    saw = [n for n in os.listdir(out / "logs") if "event=pool_call_failed" in (out / "logs" / n).read_text()]
    assert saw and all(n.startswith("inference") for n in saw), saw
