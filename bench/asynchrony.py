"""Async benchmark: wall time for the tiny demo to reach a target greedy eval accuracy, synchronous
(max_staleness 0: the replica waits for every version) against asynchronous (max_staleness 1 and 2),
with the same compute (one replica, one trainer, the same cores), in one run. Prints one JSON object.

Time is measured from the version-0 eval to the first eval at or above the target, so start-up is
not counted; the evals themselves cost every variant the same.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {"sync": 0, "async_1": 1, "async_2": 2}


def time_to_target(evals: list[dict], target: float) -> dict:
    """Seconds and versions from the first eval to the first one reaching `target` (None if never)."""
    if not evals:
        return {"seconds": None, "version": None, "best": None}
    evals = sorted(evals, key=lambda e: e["version"])
    start = evals[0]["unix_ms"]
    hit = next((e for e in evals if e["accuracy"] >= target), None)
    return {"seconds": round((hit["unix_ms"] - start) / 1000, 1) if hit else None,
            "version": hit["version"] if hit else None, "best": max(e["accuracy"] for e in evals)}


def main(target: float = 0.5, steps: int = 200, overrides: list[str] = ()) -> dict:
    from shared.launcher import read_jsonl, run
    from shared.run_config import load_run_config

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, staleness in VARIANTS.items():
            config = load_run_config(ROOT / "configs" / "tiny-arith.toml", [
                f"run.steps={steps}", f"run.max_staleness={staleness}", "orchestrator.eval_every=10",
                "orchestrator.eval_size=200", f'run.id="bench-{name}"', *overrides])
            out = Path(tmp) / name
            summary = run(config, out, progress=False)
            evals = read_jsonl(out / "eval.jsonl")
            results[name] = {"max_staleness": staleness, "outcome": summary.get("outcome"),
                             "wall_seconds": summary.get("wall_seconds"), **time_to_target(evals, target)}
    sync = results["sync"]["seconds"]
    for name in ("async_1", "async_2"):
        mine = results[name]["seconds"]
        results[name]["speedup_vs_sync"] = round(sync / mine, 2) if sync and mine else None
    return {"benchmark": "async", "target_accuracy": target, "steps": steps, "variants": results}


if __name__ == "__main__":
    import json

    print(json.dumps(main()))
