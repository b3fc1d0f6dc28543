"""A run that can only fail is failed, with its reason, a non-zero exit and the alert's metric:
every task past the model's context (dead-lettered: `dead_share`), and a
reward that raises on every real completion (retried, then every group dropped as `reward_failed`:
`dead_share` too, with no step trained on a zero it never scored)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


def run(out: Path, *overrides: str) -> tuple[subprocess.CompletedProcess, dict]:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "steadyrl.cli",
            "run",
            str(ROOT / "configs" / "tiny-arith.toml"),
            "--out",
            str(out),
            "--set",
            "run.steps=50",
            "--set",
            "run.batch_prompts=4",
            "--set",
            "orchestrator.evals.size=8",
            *(x for o in overrides for x in ("--set", o)),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    return done, json.loads((out / "summary.json").read_text())


@pytest.mark.parametrize(
    "overrides, rule, reason",
    [
        (
            ("orchestrator.sampling.max_new_tokens=4096", "orchestrator.stop.window_tasks=40"),
            "dead_share",
            r"(\d+) of the last \1 train tasks were dead-lettered",  # the window: 40 or more, as tasks end
        ),
        pytest.param(  # slow: the rule is every-task-dies'; a failed reward is retried, then its group dropped
            ('orchestrator.reward="tests.rewards:explode_after_dry_call"', "orchestrator.stop.window_tasks=40"),
            "dead_share",
            r"(\d+) of the last \1 train tasks were dead-lettered",
            marks=pytest.mark.slow,
        ),
    ],
    ids=["every-task-dies", "every-reward-raises"],
)
def test_a_run_that_can_only_fail_is_failed_with_its_reason(tmp_path, tiny_model_dir, overrides, rule, reason):
    done, summary = run(tmp_path / "run", *overrides)
    assert done.returncode == 1, done.stderr[-3000:]
    assert summary["outcome"] == "failed" and summary["error"].startswith(f"{rule}: "), summary
    assert re.search(reason, summary["error"]) and summary["final_status"]["failure"]["rule"] == rule
    assert summary["steps"] < 50
    if "explode" in overrides[0]:  # no step trains a zero for a reward that failed: none at all
        assert summary["steps"] == 0
    log = (tmp_path / "run" / "logs" / "orchestrator.log").read_text()
    assert f"event=run_failed run=tiny-arith rule={rule}" in log
