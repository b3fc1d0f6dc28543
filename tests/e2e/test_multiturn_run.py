"""`steadyrl run configs/tiny-tools.toml`: multi-turn RL with a tool learns on this CPU — greedy eval
accuracy up by at least 0.10 over the cold start, the sampled trajectories' tool-call success rising,
the per-turn diagnostics in metrics.jsonl and plotted."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
TURN_KEYS = (
    "turns_mean",
    "turn_tokens_mean",
    "env_tokens_fraction",
    "trajectories_done",
    "env_tool_calls",
    "env_tool_success",
)


def test_tiny_tools_learns_to_call_the_calculator(tmp_path, calc_model_dir):
    out = tmp_path / "run"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "steadyrl.cli",
            "run",
            str(ROOT / "configs" / "tiny-tools.toml"),
            "--out",
            str(out),
            "--set",
            "run.steps=20",
            "--set",
            "orchestrator.evals.every=10",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["outcome"] == "finished" and summary["steps"] == 20, summary
    assert summary["eval_end"] >= summary["eval_start"] + 0.10, summary
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(1, 21))
    for key in TURN_KEYS:
        assert all(key in x for x in lines), key
    first = lines[:3]
    last = lines[-5:]

    def mean(rows, key):
        return sum(r[key] for r in rows) / len(rows)

    assert mean(last, "env_tool_success") >= mean(first, "env_tool_success") + 0.2, (first, last)
    assert mean(last, "reward_mean") > mean(first, "reward_mean")
    # the environment's tokens are part of every trajectory but none is trained: tokens counts the model's
    assert all(0 < x["env_tokens_fraction"] < 1 and x["turns_mean"] >= 1 for x in lines)
    for name in ("turns_mean", "env_tool_success", "env_tool_calls"):
        assert f"plots/{name}.png" in summary["plots"] and (out / "plots" / f"{name}.png").stat().st_size > 0


# slow: a verifiers environment plays through a replica in tests/integration/test_verifiers.py
@pytest.mark.parametrize("player", ["agent", pytest.param("verifiers", marks=pytest.mark.slow)])
def test_an_agent_program_or_a_verifiers_environment_drives_a_training_run(tmp_path, calc_model_dir, player):
    """The same recipe played by an unmodified agent program (tests/agent_calc.py), or by a
    `verifiers` environment's own rollout loop and rubric (tests/vf_calc.py, its own dataset),
    through the replicas' OpenAI-compatible endpoint: their rollouts are trained."""
    out = tmp_path / "run"
    played = (
        [f'orchestrator.trajectory.environment="agent:{sys.executable} -m tests.agent_calc"']
        if player == "agent"
        else [
            'orchestrator.trajectory.environment="verifiers:tests.vf_calc"',
            'orchestrator.data.task="verifiers"',
            f'model.path="{calc_model_dir}"',
        ]
    )  # "tiny" names the calc model for task calc alone
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "steadyrl.cli",
            "run",
            str(ROOT / "configs" / "tiny-tools.toml"),
            "--out",
            str(out),
            "--set",
            "run.steps=3",
            "--set",
            "run.batch_prompts=4",
            "--set",
            "run.group_size=4",
            "--set",
            "orchestrator.evals.every=0",
            *[a for s in played for a in ("--set", s)],
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["outcome"] == "finished" and summary["steps"] == 3, summary
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3]
    assert all(x["env_model_calls"] == x["turns_mean"] >= 1 and x["tokens"] > 0 for x in lines), lines
    if player == "verifiers":  # the rubric's metrics ride along: its reward function's mean is the reward's
        assert all(
            abs(x["env_correct"] - x["reward_mean"]) < 1e-6 and x["env_num_turns"] == x["turns_mean"] for x in lines
        ), lines
    assert "event=agent_endpoint url=http://127.0.0.1:" in (out / "logs" / "inference-0.log").read_text()
