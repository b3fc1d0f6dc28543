"""Async benchmark: wall time for the tiny demo to reach a target greedy eval accuracy, synchronous
(max_staleness 0: the replica waits for every version) against asynchronous (max_staleness 1 and 2),
with the same compute (one replica, one trainer, the same cores), in one run. Prints one JSON object.

Time is measured from the version-0 eval until three consecutive evals average the target, so
start-up is not counted and one lucky eval does not decide; the evals cost every variant the same.
Training speed (versions per second between the first and last eval) is reported beside it.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {"sync": 0, "async_1": 1, "async_2": 2}


def time_to_target(evals: list[dict], target: float, window: int = 3) -> dict:
    """Seconds and versions from the first eval until the mean of `window` consecutive evals first
    reaches `target` (None if never), timed at the last eval of that window: one lucky eval on 200
    problems (±3.5 points) does not decide it. Also the seconds per version between the first and
    the last eval (training speed, start-up excluded)."""
    if not evals:
        return {"seconds": None, "version": None, "best": None, "seconds_per_version": None}
    evals = sorted(evals, key=lambda e: e["version"])
    start = evals[0]["unix_ms"]
    hit = None
    for end in range(window, len(evals) + 1):
        if sum(e["accuracy"] for e in evals[end - window : end]) / window >= target:
            hit = evals[end - 1]
            break
    span = evals[-1]["version"] - evals[0]["version"]
    return {
        "seconds": round((hit["unix_ms"] - start) / 1000, 1) if hit else None,
        "version": hit["version"] if hit else None,
        "best": max(e["accuracy"] for e in evals),
        "seconds_per_version": round((evals[-1]["unix_ms"] - start) / 1000 / span, 4) if span else None,
    }


def main(target: float = 0.5, steps: int = 200, overrides: list[str] = ()) -> dict:
    """Each variant is a whole `steadyrl run`, started as a user starts it (the console script
    beside this interpreter), one after another."""
    import json
    import subprocess
    import sys

    from shared.runtime.jsonl import read_jsonl

    steadyrl = Path(sys.executable).with_name("steadyrl")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, staleness in VARIANTS.items():
            out = Path(tmp) / name
            settings = [
                f"run.steps={steps}",
                f"run.max_staleness={staleness}",
                "orchestrator.evals.every=10",
                "orchestrator.evals.size=200",
                f'run.id="bench-{name}"',
                *overrides,
            ]
            subprocess.run(
                [
                    str(steadyrl),
                    "run",
                    str(ROOT / "configs" / "tiny-arith.toml"),
                    "--out",
                    str(out),
                    "--progress",
                    "none",
                    *(a for s in settings for a in ("--set", s)),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                check=False,
            )
            summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
            evals = read_jsonl(out / "eval.jsonl")
            results[name] = {
                "max_staleness": staleness,
                "outcome": summary.get("outcome"),
                "wall_seconds": summary.get("wall_seconds"),
                **time_to_target(evals, target),
            }
    sync, sync_speed = results["sync"]["seconds"], results["sync"]["seconds_per_version"]
    for name in ("async_1", "async_2"):
        mine = results[name]["seconds"]
        speed = results[name]["seconds_per_version"]
        results[name]["speedup_vs_sync"] = round(sync / mine, 2) if sync and mine else None
        results[name]["versions_per_second_vs_sync"] = round(sync_speed / speed, 2) if sync_speed and speed else None
    return {"benchmark": "async", "target_accuracy": target, "steps": steps, "variants": results}


if __name__ == "__main__":
    import json

    print(json.dumps(main()))
