"""`steadyrl bench peers`: steadyrl against TRL's GRPOTrainer on steadyrl's own demo, in one run.

In each pair steadyrl runs the demo as it ships (its eval rounds included) and with its evals off;
TRL runs with the settings that make it fastest here (`peers_trl.CHOSEN`), the recipe matched
(`peers_trl` prints its GRPOConfig). One eval loop scores both sides' models every `every` steps.
Ratios are steadyrl / TRL of each side's mean curve over interleaved pairs, the machine's load
beside each run. TRL runs with a Python that has it (the `compare` extra in a venv of its own).
Details: docs/internals/bench.md#steadyrlpeerspy-steadyrlpeers_trlpy
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.load import Load
from steadyrl.peers_trl import CHOSEN

ROOT = Path(__file__).resolve().parents[1]
TARGETS = {
    "seconds_per_step": 0.6,
    "seconds_per_step_evals_off": 0.5,
    "command_seconds": 0.8,
    "seconds_to_eval_0.6": 0.7,
    "eval_at_equal_steps": 0.95,
}
SIDES = {"as_shipped": True, "evals_off": False}  # steadyrl's two runs in each pair: its eval rounds on or off
DIFFERENCES = [
    "TRL samples with the model it trains, exactly on policy: it computes no old log-probs and no "
    "importance weight; steadyrl samples on its inference replica in the recipe's inference dtype, "
    "up to max_staleness versions behind, and corrects both with MiniRL's IS weights",
    "steadyrl runs its trainer and its replica as separate processes, one torch thread each (two cores); "
    "TRL generates and trains in one process on one thread",
    "TRL clips its ratio at ε = 0.2 (inactive on policy); steadyrl's clipping follows the recipe",
    "steadyrl writes a checkpoint every `every` steps as part of its run; TRL's saves are left out of its clock",
]
COMPARE_VENV = "STEADYRL_EXTRAS=compare STEADYRL_LINK=.venv-compare scripts/install"


def first_at(curve: list[dict], accuracy: float) -> float | None:
    """Seconds at the first point of the curve whose eval reaches `accuracy` (None: never)."""
    return next((p["seconds"] for p in curve if p["accuracy"] >= accuracy), None)


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def score(model_dir: Path, recipe: Path) -> float:
    from steadyrl.evaluation import evaluate

    return evaluate(str(model_dir), [recipe], samples=0, dtype="float32")["accuracy"]


def run_trl(python: str, model: str, recipe: Path, steps: int, every: int, out: Path) -> dict:
    with Load() as load:
        result = _run_trl(python, model, recipe, steps, every, out)
    return {**result, **load.record()}


def _run_trl(python: str, model: str, recipe: Path, steps: int, every: int, out: Path) -> dict:
    started = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [python, "-m", "steadyrl.peers_trl", model, str(recipe), str(steps), str(every), str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the TRL side failed ({done.returncode}): {done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["command_seconds"] = round(time.perf_counter() - started, 1)
    result["curve"] = [
        {"step": p["step"], "seconds": p["seconds"], "accuracy": score(out / f"step-{p['step']:06d}", recipe)}
        for p in result.pop("saved")
    ]
    return result


def run_steadyrl(model: str, recipe: Path, steps: int, every: int, out: Path, evals: bool) -> dict:
    """`steadyrl run` of the recipe for `steps` steps, a checkpoint every `every`; `evals`: its
    eval rounds as the recipe sets them (as shipped), else none."""
    from shared.runtime.jsonl import read_jsonl
    from steadyrl.report import export_checkpoint

    settings = [
        f"run.steps={steps}",
        *([] if evals else ["orchestrator.evals.every=0"]),
        f"trainer.checkpoint.every={every}",
        f"trainer.checkpoint.keep={steps // every + 2}",
    ]
    started = time.perf_counter()
    command = [str(Path(sys.executable).with_name("steadyrl")), "run", str(recipe), "--out", str(out)]
    with Load() as load:
        done = subprocess.run(
            [*command, "--progress", "none", *(a for s in settings for a in ("--set", s))],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=3600,
        )
    seconds = round(time.perf_counter() - started, 1)
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    if done.returncode != 0 or summary.get("outcome") != "finished":
        raise RuntimeError(f"the steadyrl side failed ({done.returncode}): {done.stderr[-2000:]}")
    at = {int(m["step"]): int(m["unix_ms"]) for m in read_jsonl(out / "metrics.jsonl")}
    curve = []
    for checkpoint in sorted((out / "trainer" / "checkpoints").glob("step-*")):
        step = int(checkpoint.name.removeprefix("step-"))
        exported = export_checkpoint(model, checkpoint, out / "exported" / checkpoint.name)
        curve.append({"step": step, "seconds": (at[step] - at[1]) / 1000, "accuracy": score(exported, recipe)})
    return {
        "command_seconds": seconds,
        "trainer_idle_share": summary.get("trainer_idle_share"),
        "replica_idle_share": summary.get("replica_idle_share"),
        "curve": curve,
        **load.record(),
    }


def mean_curve(curves: list[list[dict]]) -> list[dict]:
    """The pointwise mean of curves sampled at the same steps (seconds None at step 0). Pure."""
    points = []
    steps = [[p["step"] for p in curve] for curve in curves]
    if any(s != steps[0] for s in steps):
        raise ValueError(f"the runs' curves are sampled at different steps: {steps}")
    for at in zip(*curves, strict=True):
        seconds = [p["seconds"] for p in at]
        points.append(
            {
                "step": at[0]["step"],
                "seconds": None if None in seconds else round(sum(seconds) / len(seconds), 3),
                "accuracy": round(sum(p["accuracy"] for p in at) / len(at), 4),
            }
        )
    return points


def compare(ours: list[dict], trl: list[dict], steps: int) -> dict:
    """steadyrl / TRL ratios of two curves that start at step 0 (the base model). Pure."""
    by_step = {p["step"]: p["accuracy"] for p in ours}
    at_steps = [(p["step"], by_step[p["step"]], p["accuracy"]) for p in trl if p["step"] in by_step]
    equal = [(o, t) for _, o, t in at_steps]
    last_quarter = [(o, t) for step, o, t in at_steps if step > steps * 3 // 4]
    return {
        "seconds_per_step": ratio(_per_step(ours), _per_step(trl)),
        **{f"seconds_to_eval_{a}": ratio(first_at(ours[1:], a), first_at(trl[1:], a)) for a in (0.5, 0.6)},
        "eval_at_equal_steps": ratio(equal[-1][0], equal[-1][1]),
        "eval_at_equal_steps_last_quarter": ratio(
            sum(o for o, _ in last_quarter), sum(t for _, t in last_quarter) if last_quarter else None
        ),
    }


def _per_step(curve: list[dict]) -> float:
    """Wall seconds per step: the last point's seconds (counted from the end of step 1) over its steps."""
    return round(curve[-1]["seconds"] / (curve[-1]["step"] - 1), 4)


def main(
    steps: int = 0, every: int = 10, recipe: Path | None = None, peer_python: str | None = None, pairs: int = 3
) -> dict:
    """`pairs` interleaved rounds (TRL, steadyrl as shipped, steadyrl with evals off, TRL, ...) of
    `steps` steps each (0: the recipe's); the ratios are those of each side's mean curve (one
    300-problem eval moves by about 3 points: a single pair's ratios at an accuracy spread by
    ±0.3), each pair's own beside them, with the machine's load around every run."""
    import tomllib

    from shared.kit.tiny import init_tiny_model

    recipe = recipe or ROOT / "configs" / "tiny-arith.toml"
    steps = steps or int(tomllib.loads(recipe.read_text())["run"]["steps"])
    python = peer_python or str(ROOT / ".venv-compare" / "bin" / "python")
    if not Path(python).exists():
        raise RuntimeError(f"no Python with TRL at {python}: make one with `{COMPARE_VENV}` or pass --peer-python")
    model = str(init_tiny_model())
    base = {"step": 0, "seconds": None, "accuracy": score(Path(model), recipe)}
    runs = []
    for _ in range(pairs):
        with tempfile.TemporaryDirectory() as tmp:
            trl = run_trl(python, model, recipe, steps, every, Path(tmp) / "trl")
            ours = {
                side: run_steadyrl(model, recipe, steps, every, Path(tmp) / side, evals)
                for side, evals in SIDES.items()
            }
        for run in (trl, *ours.values()):
            run["curve"].insert(0, dict(base))
        runs.append((ours, trl))
    trl = {
        "config": runs[0][1]["config"],
        "chosen": {name: {"value": v, "why": why} for name, (v, why) in CHOSEN.items()},
        **_side([t for _, t in runs]),
    }
    result = {
        "benchmark": "peers",
        "peer": "trl.GRPOTrainer",
        "recipe": str(recipe.relative_to(ROOT)) if recipe.is_relative_to(ROOT) else str(recipe),
        "steps": steps,
        "eval_every": every,
        "pairs": pairs,
        "trl": trl,
        "targets": TARGETS,
        "differences": DIFFERENCES,
    }
    for side in SIDES:
        ours = _side([o[side] for o, _ in runs])
        ratios = compare(ours["curve"], trl["curve"], steps)
        ratios["command_seconds"] = ratio(ours["command_seconds"], trl["command_seconds"])
        result[f"steadyrl_{side}"] = ours
        result[f"ratios_{side}"] = ratios
        result[f"pair_ratios_{side}"] = [
            {
                **compare(o[side]["curve"], t["curve"], steps),
                "command_seconds": ratio(o[side]["command_seconds"], t["command_seconds"]),
            }
            for o, t in runs
        ]
    result["targets_met"] = targets_met(result)
    return result


def _side(runs: list[dict]) -> dict:
    """One side's runs in one record: the mean curve, mean command seconds and idle shares, and
    each run's load."""
    side = {
        "command_seconds": _mean([r["command_seconds"] for r in runs], 1),
        "curve": mean_curve([r["curve"] for r in runs]),
        "load": [{k: r.get(k) for k in ("load_1min_before", "machine_busy_share")} for r in runs],
    }
    for share in ("trainer_idle_share", "replica_idle_share"):
        if share in runs[0]:
            side[share] = _mean([r[share] for r in runs], 3)
    side["seconds_per_step"] = _per_step(side["curve"])
    return side


def targets_met(result: dict) -> dict[str, bool | None]:
    """Each target against its ratio: as shipped for seconds per step, the whole command and
    seconds to eval 0.6; evals off for `seconds_per_step_evals_off`; eval at equal steps on both.
    None where a ratio is missing (an accuracy never reached). Pure."""
    shipped, off, t = result["ratios_as_shipped"], result["ratios_evals_off"], result["targets"]

    def at_most(value, target):
        return None if value is None else value <= target

    equal = [r["eval_at_equal_steps"] for r in (shipped, off)]
    return {
        "seconds_per_step": at_most(shipped["seconds_per_step"], t["seconds_per_step"]),
        "seconds_per_step_evals_off": at_most(off["seconds_per_step"], t["seconds_per_step_evals_off"]),
        "command_seconds": at_most(shipped["command_seconds"], t["command_seconds"]),
        "seconds_to_eval_0.6": at_most(shipped["seconds_to_eval_0.6"], t["seconds_to_eval_0.6"]),
        "eval_at_equal_steps": None if None in equal else min(equal) >= t["eval_at_equal_steps"],
    }


def _mean(values: list, digits: int):
    values = [v for v in values if v is not None]
    return round(sum(values) / len(values), digits) if values else None


if __name__ == "__main__":
    args = sys.argv[1:]
    print(json.dumps(main(*(int(a) for a in args[:2]))))
