"""`steadyrl replay-alerts RUN_DIR`: would the alert rules have fired on this run?

The run's metrics.jsonl, eval.jsonl and policy-eval.jsonl become the series the trainer and the orchestrator export,
one step per minute, and `promtool test rules` evaluates every alert that reads them at every minute: the rules'
windows (a 30 m mean, a 10 m delta, `for: 5m`) span 30, 10 and 5 steps. Needs promtool on PATH.

Details: docs/internals/cli.md"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import yaml

from shared.runtime.jsonl import read_jsonl

TRAINER_SERIES = "steadyrl_trainer_last_metric"
EVAL_SERIES = "steadyrl_orchestrator_eval_accuracy"
POLICY_SERIES = "steadyrl_orchestrator_policy_eval_accuracy"
POLICY_INITIAL_SERIES = "steadyrl_orchestrator_policy_eval_initial_accuracy"
POLICY_PREVIOUS_SERIES = "steadyrl_orchestrator_policy_eval_previous_accuracy"
INSTANCE = "trainer:replay"
FAILURE = re.compile(r"alertname: (\S+), time: ([0-9ywdhms]+),\s*exp:\[\],\s*got:\[\s*0:", re.MULTILINE)
UNIT_MINUTES = {"y": 525_600, "w": 10_080, "d": 1_440, "h": 60, "m": 1}
RENAMED = {"staleness_max": "staleness_peak"}  # metrics.jsonl keys of older runs → the names the rules read


def minutes(duration: str) -> int:
    """A Prometheus duration as promtool prints it ("1d2h30m", "45m", "0s") in whole minutes."""
    return sum(int(n) * UNIT_MINUTES[u] for n, u in re.findall(r"(\d+)(ms|[ywdhms])", duration) if u in UNIT_MINUTES)


def replayed_alerts(rules_file: Path) -> list[str]:
    """The alerts of a rule file whose expression reads the trainer's per-step metrics or the evals."""
    groups = yaml.safe_load(Path(rules_file).read_text())["groups"]
    return [
        r["alert"]
        for g in groups
        for r in g["rules"]
        if "alert" in r and any(series in r["expr"] for series in (TRAINER_SERIES, EVAL_SERIES, POLICY_SERIES))
    ]


def eval_values(evals: list[dict], steps: int) -> dict[str, str]:
    """eval set → promtool values, one per minute: each round's accuracy from its step on ("_"
    before the first)."""
    out = {}
    for name in sorted({n for e in evals for n in (e.get("sets") or {"main": None})}):
        at_minute = {
            max(e["step"] - 1, 0): (e.get("sets") or {}).get(name, {}).get("accuracy", e["accuracy"])
            for e in sorted(evals, key=lambda e: e["step"])
            if name == "main" or name in e.get("sets", {})
        }
        values = []
        current = None
        for minute in range(steps):
            current = at_minute.get(minute, current)
            values.append("_" if current is None else repr(float(current)))
        out[name] = " ".join(values)
    return out


def replay_test(
    rows: list[dict],
    rules_file: Path,
    alerts: list[str],
    gauges: dict[str, float] | None = None,
    evals: list[dict] = (),
    policy_evals: list[dict] = (),
) -> dict:
    """A promtool test file: every numeric key of `rows` as a series (step s at minute s − 1), the
    eval rounds (μ's `evals`, π's `policy_evals`, π's first round, and each π round as the previous
    one from the next round's step on, all held from their step on), each
    of `gauges` (metric → value, e.g. the run's max_staleness) held for the whole run, and, for each
    alert, a check at every minute that it is quiet — promtool reports each check it fails, which is
    each minute the alert fires."""
    rows = sorted({r["step"]: r for r in rows}.values(), key=lambda r: r["step"])  # a resumed step counts once
    keys = sorted({k for r in rows for k, v in r.items() if isinstance(v, int | float) and not isinstance(v, bool)})
    series = []
    for key in keys:
        values = " ".join("_" if not isinstance(r.get(key), int | float) else repr(float(r[key])) for r in rows)
        series.append(
            {
                "series": f'{TRAINER_SERIES}{{name="{key}", instance="{INSTANCE}", job="steadyrl-trainer"}}',
                "values": values,
            }
        )
    policy_evals = sorted(policy_evals, key=lambda e: e["step"])
    previous = [
        {**before, "step": after["step"]} for before, after in zip(policy_evals, policy_evals[1:], strict=False)
    ]
    for metric, rounds in (
        (EVAL_SERIES, list(evals)),
        (POLICY_SERIES, policy_evals),
        (POLICY_INITIAL_SERIES, policy_evals[:1]),
        (POLICY_PREVIOUS_SERIES, previous),
    ):
        for name, values in eval_values(rounds, len(rows)).items():
            series.append(
                {
                    "series": f'{metric}{{set="{name}", instance="orchestrator:replay", job="steadyrl"}}',
                    "values": values,
                }
            )
    for metric, value in (gauges or {}).items():
        series.append(
            {
                "series": f'{metric}{{instance="{INSTANCE}", job="steadyrl-trainer"}}',
                "values": f"{float(value)!r}x{max(len(rows) - 1, 0)}",
            }
        )
    checks = [{"eval_time": f"{m}m", "alertname": a, "exp_alerts": []} for a in alerts for m in range(len(rows))]
    return {
        "rule_files": [str(Path(rules_file).resolve())],
        "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": series, "alert_rule_test": checks}],
    }


def firing_steps(
    rows: list[dict],
    rules_file: Path,
    gauges: dict[str, float] | None = None,
    evals: list[dict] = (),
    policy_evals: list[dict] = (),
) -> dict[str, list[int]]:
    """alert → the steps (minute + 1) at which it fires on this run's series."""
    promtool = shutil.which("promtool")
    if promtool is None:
        raise RuntimeError("promtool is needed (Prometheus' test tool; Debian: apt-get install prometheus)")
    alerts = replayed_alerts(rules_file)
    with tempfile.TemporaryDirectory() as tmp:
        test = Path(tmp) / "replay_test.yml"
        test.write_text(
            yaml.safe_dump(replay_test(rows, rules_file, alerts, gauges, evals, policy_evals), sort_keys=False)
        )
        done = subprocess.run([promtool, "test", "rules", str(test)], capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    failures = FAILURE.findall(output)  # a failed quiet check is a minute the alert fires
    if done.returncode != 0 and not failures:  # promtool failed otherwise (rules that do not load, ...)
        raise RuntimeError(f"promtool failed: {output[-2000:]}")
    fired: dict[str, list[int]] = {a: [] for a in alerts}
    for name, when in failures:
        fired[name].append(minutes(when) + 1)
    return {a: sorted(set(steps)) for a, steps in fired.items()}


def replay_run(run_dir: Path, rules_file: Path) -> dict:
    rows = [{RENAMED.get(k, k): v for k, v in row.items()} for row in _first_jsonl(run_dir, "metrics.jsonl", "trainer")]
    evals, policy_evals = (_first_jsonl(run_dir, name) for name in ("eval.jsonl", "policy-eval.jsonl"))
    gauges = {}
    recipe = Path(run_dir) / "config.resolved.toml"
    if recipe.is_file():  # the settings the trainer exports as gauges
        import tomllib

        gauges["steadyrl_trainer_max_staleness"] = tomllib.loads(recipe.read_text())["run"]["max_staleness"]
    return {
        "run": str(run_dir),
        "steps": len({r["step"] for r in rows}),
        "firing_steps": firing_steps(rows, rules_file, gauges, evals, policy_evals),
    }


def _first_jsonl(run_dir: Path, name: str, service: str = "orchestrator") -> list[dict]:
    """The lines of RUN_DIR/NAME, else RUN_DIR/SERVICE/NAME ([] when neither exists)."""
    path = next((p for p in (Path(run_dir) / name, Path(run_dir) / service / name) if p.is_file()), None)
    return read_jsonl(path)
