"""One whole `steadyrl run` of a recipe as a user starts it (the console script beside this
interpreter), for the benchmarks that compare runs: its metrics.jsonl lines, eval.jsonl rounds and
summary, or RuntimeError with the run's last stderr when it did not finish."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def run_demo(recipes: list[Path], out: Path, settings: list[str]) -> tuple[list[dict], list[dict], dict]:
    from shared.runtime.jsonl import read_jsonl

    command = [str(Path(sys.executable).with_name("steadyrl")), "run", *map(str, recipes), "--out", str(out)]
    done = subprocess.run(
        [*command, "--progress", "none", *(a for s in settings for a in ("--set", s))],
        capture_output=True,
        text=True,
        check=False,
    )
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    if done.returncode != 0 or summary.get("outcome") != "finished":
        raise RuntimeError(f"the run in {out.name} failed ({done.returncode}): {done.stderr[-2000:]}")
    return read_jsonl(out / "metrics.jsonl"), read_jsonl(out / "eval.jsonl"), summary


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b to 3 places (None when either is missing or b is 0)."""
    return round(a / b, 3) if a is not None and b else None
