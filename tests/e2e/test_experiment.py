"""`steadyrl experiment`: a 2 × 2 grid of real (short) runs, its table, CSV and plots, and a resume
that runs nothing twice."""

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # the default suite runs the grids of configs/ (below) through the same runner
def test_experiment_grid_runs_every_seed_and_writes_the_table(tmp_path, tiny_model_dir):
    grid = tmp_path / "grid.toml"
    grid.write_text(f'''
[grid]
base = "{ROOT / "configs" / "tiny-arith.toml"}"
set = ["run.steps=2", "run.batch_prompts=4", "run.max_staleness=0", "trainer.recipe=manual",
       "orchestrator.evals.every=2", "orchestrator.evals.size=20"]
[collapse]
entropy_below = 10.0
[[config]]
name = "n2-r2"
label = "N=2 + R2"
set = ["trainer.mini_batches=2", "trainer.routing_replay=r2"]
''')
    out = tmp_path / "exp"
    command = [sys.executable, "-m", "steadyrl.cli", "experiment", str(grid), "--seeds", "2", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["runs"] == 2 and result["configs"] == 1  # a row per configuration: tests/unit/test_experiment.py
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert [(r["config"], r["seed"]) for r in rows] == [("n2-r2", "0"), ("n2-r2", "1")]
    for row in rows:
        assert row["outcome"] == "finished" and row["steps"] == "2"
        assert row["collapsed"] == "True" and row["collapse_reason"].startswith("entropy")  # the rule is applied
        assert 0 <= float(row["eval_final"]) <= 1
    seeds = [(out / "n2-r2" / f"seed-{s}" / "config.resolved.toml").read_text().count("seed = 1") for s in (0, 1)]
    assert seeds == [0, 2]  # seed 1 sets trainer.seed and orchestrator.data.seed
    table = (out / "table.md").read_text().splitlines()
    assert len(table) == 3 and table[2].startswith("| N=2 + R2 |") and table[2].endswith("| 2/2 |")
    assert {"plots/reward_mean.png", "plots/eval_accuracy.png", "plots/mismatch_kl_k3.png"} <= set(result["plots"])
    # a second call finds every run finished and only rewrites the report
    again = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert again.returncode == 0 and again.stderr.count("finished before, kept") == 2


def test_grid_v2_runs_fp8_inference_on_mul_trace_with_the_papers_geometry(tmp_path):
    """One configuration of configs/paper-grid-v2.toml, cut to 2 steps: the tiny model cold-started
    on mul_trace, fp8-weight inference, DPPO at N = 4 with the global batch 4 × the mini-batch."""
    out = tmp_path / "v2"
    command = [
        sys.executable,
        "-m",
        "steadyrl.cli",
        "experiment",
        str(ROOT / "configs" / "paper-grid-v2.toml"),
        "--seeds",
        "1",
        "--out",
        str(out),
        "--only",
        "n4-dppo",
        "--set",
        "run.steps=2",
        "--set",
        "run.mini_batch_prompts=2",
        "--set",
        "orchestrator.evals.size=20",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    run = out / "n4-dppo" / "seed-0"
    resolved = (run / "config.resolved.toml").read_text()
    assert "batch_prompts = 8\n" in resolved and 'quantization = "fp8"' in resolved  # B = N × 2 prompts
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["valid_tokens"] > 8 * 8 for m in metrics)  # 64 answers, several tokens each
    model = json.loads(
        (Path(json.loads((run / "summary.json").read_text())["model"]) / "steadyrl_tiny.json").read_text()
    )
    assert model["task"]["name"] == "mul_trace" and model["greedy_accuracy"] >= 0.3


def test_the_fp4_grid_trains_through_nvfp4_w4a4_inference_with_r3(tmp_path):
    """One configuration of configs/paper-grid-fp4.toml, cut to 2 steps: the replica computes in
    NVFP4 W4A4 (its mismatch KL far above bf16's) and returns routing traces the trainer replays."""
    out = tmp_path / "fp4"
    command = [
        sys.executable,
        "-m",
        "steadyrl.cli",
        "experiment",
        str(ROOT / "configs" / "paper-grid-fp4.toml"),
        "--seeds",
        "1",
        "--out",
        str(out),
        "--only",
        "n1-minirl-r3",
        "--set",
        "run.steps=2",
        "--set",
        "orchestrator.evals.size=20",
        "--set",
        "trainer.checkpoint.every=1",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    run = out / "n1-minirl-r3" / "seed-0"
    resolved = (run / "config.resolved.toml").read_text()
    assert 'quantization = "fp4"' in resolved and "quantize_activations = true" in resolved
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    # bf16 alone gives ~6e-3 on this model; NVFP4 W4A4 steps run 0.015-0.12 (one step of 300 under 0.02)
    kl = [m["mismatch_kl_k3"] for m in metrics]
    assert max(kl) > 0.02 and min(kl) > 0.01, kl
    assert all(m["routing_agreement"] < 1 for m in metrics)
    # the trainer's model (fp32, unquantized) scored on the run's eval set: the model it started from
    # (version 0) and the checkpoints it kept (versions 1 and 2, the final model)
    pi = [json.loads(line) for line in (run / "model-evals.jsonl").read_text().splitlines()]
    assert [e["version"] for e in pi] == [0, 1, 2]
    assert pi[0]["model"] == json.loads((run / "summary.json").read_text())["model"]
    assert all(e["dtype"] == "float32" and e["prompts"] == 20 and 0 <= e["accuracy"] <= 1 for e in pi)
    row = next(csv.DictReader((out / "results.csv").open()))
    assert float(row["initial_model_eval"]) == pi[0]["accuracy"] and float(row["final_model_eval"]) == pi[2]["accuracy"]
    # the final_model_drop rule (other rules, μ's eval drop, may flag the run too)
    assert ("final model" in row["collapse_reason"]) == (round(pi[0]["accuracy"] - pi[2]["accuracy"], 9) > 0.1)
    assert (out / "plots" / "model_eval_accuracy.png").stat().st_size > 10_000
    again = subprocess.run([*command, "--report-only"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert (done.stdout + done.stderr).count("in float32: eval") == 3 and again.returncode == 0
    assert "in float32: eval" not in again.stdout + again.stderr  # each version scored once, then read back
    assert [json.loads(line) for line in (run / "model-evals.jsonl").read_text().splitlines()] == pi
    assert "| final model eval (float32) |" in (out / "table.md").read_text().splitlines()[0]
