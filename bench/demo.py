"""`steadyrl bench demo`: the demo as it ships (`steadyrl run configs/tiny-arith.toml`, nothing
overridden), run several times one after another; each run's figures and their spread (min–max).
The pages that quote the demo (README, home, quickstart) render these figures from docs/results.json
(docs/internals/docs-site.md#figures)."""

from __future__ import annotations

import json
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "configs" / "tiny-arith.toml"


def one_run(out: Path) -> dict:
    """One run as a user starts it: what its summary, metrics.jsonl and eval.jsonl say."""
    from bench.demo_run import run_demo
    from bench.load import Load

    started = time.perf_counter()
    with Load() as load:
        metrics, evals, summary = run_demo([RECIPE], out, [])
    command_seconds = time.perf_counter() - started
    progress = summary["final_status"]["progress"]
    stamps = [m["unix_ms"] for m in metrics]
    return {
        "command_seconds": round(command_seconds, 1),
        "wall_seconds": summary["wall_seconds"],
        # the first step's end to the last's, over the steps between them, times the steps
        "steps_seconds": round((stamps[-1] - stamps[0]) / 1000 * len(stamps) / max(len(stamps) - 1, 1), 1),
        "steps": summary["steps"],
        "tokens": summary["tokens"],
        "eval_start": round(evals[0]["accuracy"], 4),
        "eval_end": round(evals[-1]["accuracy"], 4),
        "eval_best": round(max(e["accuracy"] for e in evals), 4),
        "eval_version_end": evals[-1]["version"],
        "eval_prompts": evals[-1]["prompts"],
        "submitted": progress["submitted"],
        "dropped": progress["dropped"],
        "dead": progress["dead"],
        "trainer_idle_share": summary["trainer_idle_share"],
        "replica_idle_share": summary["replica_idle_share"],
        **load.record(),
    }


def spread(runs: list[dict]) -> dict:
    """Per figure, its min and max over the runs (numbers only). Pure."""
    keys = [k for k, v in runs[0].items() if isinstance(v, int | float) and not isinstance(v, bool)]
    return {k: [min(r[k] for r in runs), max(r[k] for r in runs)] for k in keys}


def main(runs: int = 3) -> dict:
    recipe = tomllib.loads(RECIPE.read_text())
    with tempfile.TemporaryDirectory(prefix="steadyrl-bench-demo-") as tmp:
        measured = [one_run(Path(tmp) / f"run-{i}") for i in range(runs)]
    return {
        "benchmark": "demo",
        "recipe": "configs/tiny-arith.toml",
        "command": "steadyrl run configs/tiny-arith.toml",
        "batch_prompts": recipe["run"]["batch_prompts"],
        "group_size": recipe["run"]["group_size"],
        "runs": measured,
        "spread": spread(measured),
    }


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)))
