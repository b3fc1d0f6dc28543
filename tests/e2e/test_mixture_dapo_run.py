"""configs/tiny-mixture-dapo.toml run for real (`steadyrl run`, every service, Redis): two weighted
sources, GSPO, dynamic sampling, soft overlong punishment and a KL to the reference in the reward —
each step trains a full batch of groups with unequal rewards, the filtered groups are counted and
replaced, every task is settled exactly once, and rewards and evals come per source."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_mixture_dapo_recipe_trains_full_informative_batches(tmp_path, tiny_model_dir):
    out = tmp_path / "run"
    settings = [
        "run.steps=10",
        "run.batch_prompts=8",
        "orchestrator.evals.every=5",
        "orchestrator.evals.size=40",
        "trainer.checkpoint.every=5",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "steadyrl.cli", "run", str(ROOT / "configs" / "tiny-mixture-dapo.toml")]
        + ["--out", str(out), "--progress", "none", *(a for s in settings for a in ("--set", s))],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["outcome"] == "finished" and summary["steps"] == 10, summary
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(1, 11))
    # the auto recipe adds R2 on a step with a stale token
    recipes = {x["recipe"] for x in lines}
    assert recipes <= {f"gspo+tis+clip{r}+kl_k3_in_reward+dynamic_sampling" for r in ("", "+r2")}, recipes
    filtered = sum(x["filtered_groups"] for x in lines)
    cap_hit = "event=dynamic_sampling_cap_hit" in (out / "logs" / "trainer.log").read_text()
    for x in lines:
        # a full batch: 8 groups of 8, from both sources, none with equal rewards (unless the cap was hit)
        assert x["source/sums2/rollouts"] + x.get("source/sums1/rollouts", 0) == 64, x
        assert x["zero_variance_share"] == 0 or cap_hit, x
        assert x["filtered_share"] == round(x["filtered_groups"] / (x["filtered_groups"] + 8), 8)
        assert x["ref_kl"] >= 0 and x["ref_kl_penalty"] >= 0 and x["reference_seconds"] > 0
    assert filtered > 0  # the 1-digit sums are new to the model: whole groups score 0
    assert sum(x.get("source/sums1/rollouts", 0) for x in lines) > 0
    # every task settled once: trained (B per step), filtered (and replaced), none lost or dead
    progress = summary["final_status"]["progress"]
    assert progress["trained"] == 80 and progress["filtered"] == filtered and progress["dead"] == 0, progress
    assert progress["submitted"] == progress["trained"] + progress["dropped"] + progress["filtered"], progress
    evals = [json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()]
    assert [e["version"] for e in evals] == [0, 5, 10]
    for e in evals:  # each source's eval split is a set of its name; main is their union
        sets = e["sets"]
        assert sets["sums2"]["prompts"] == 40 and sets["main"]["prompts"] == 40 + sets["sums1"]["prompts"], sets
        assert 0 < sets["sums1"]["prompts"] <= 40
