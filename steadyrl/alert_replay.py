"""`steadyrl replay-alerts RUN_DIR`: would the alert rules have fired on this run? The run's
metrics.jsonl becomes the series `steadyrl_trainer_last_metric{name=KEY}` the trainer exports, one
step per minute, and `promtool test rules` evaluates every alert that reads those series at every
minute. The windows of the rules (a 30 m mean, a 10 m delta, `for: 5m`) thus span 30, 10 and 5
steps. Needs promtool (Prometheus' test tool) on PATH.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import yaml

TRAINER_SERIES = "steadyrl_trainer_last_metric"
INSTANCE = "trainer:replay"
FAILURE = re.compile(r"alertname: (\S+), time: (\d+)m,\s*exp:\[\],\s*got:\[\s*0:", re.MULTILINE)


def trainer_alerts(rules_file: Path) -> list[str]:
    """The alerts of a rule file whose expression reads the trainer's per-step metrics."""
    groups = yaml.safe_load(Path(rules_file).read_text())["groups"]
    return [r["alert"] for g in groups for r in g["rules"] if "alert" in r and TRAINER_SERIES in r["expr"]]


def replay_test(rows: list[dict], rules_file: Path, alerts: list[str]) -> dict:
    """A promtool test file: every numeric key of `rows` as a series (step s at minute s − 1) and,
    for each alert, a check at every minute that it is quiet — promtool reports each check it fails,
    which is each minute the alert fires."""
    rows = sorted({r["step"]: r for r in rows}.values(), key=lambda r: r["step"])  # a resumed step counts once
    keys = sorted({k for r in rows for k, v in r.items() if isinstance(v, int | float) and not isinstance(v, bool)})
    series = []
    for key in keys:
        values = " ".join("_" if not isinstance(r.get(key), int | float) else repr(float(r[key])) for r in rows)
        series.append({"series": f'{TRAINER_SERIES}{{name="{key}", instance="{INSTANCE}", job="steadyrl-trainer"}}',
                       "values": values})
    checks = [{"eval_time": f"{m}m", "alertname": a, "exp_alerts": []} for a in alerts for m in range(len(rows))]
    return {"rule_files": [str(Path(rules_file).resolve())], "evaluation_interval": "1m",
            "tests": [{"interval": "1m", "input_series": series, "alert_rule_test": checks}]}


def firing_steps(rows: list[dict], rules_file: Path) -> dict[str, list[int]]:
    """alert → the steps (minute + 1) at which it fires on this run's series."""
    promtool = shutil.which("promtool")
    if promtool is None:
        raise RuntimeError("promtool is needed (Prometheus' test tool; Debian: apt-get install prometheus)")
    alerts = trainer_alerts(rules_file)
    with tempfile.TemporaryDirectory() as tmp:
        test = Path(tmp) / "replay_test.yml"
        test.write_text(yaml.safe_dump(replay_test(rows, rules_file, alerts), sort_keys=False))
        done = subprocess.run([promtool, "test", "rules", str(test)], capture_output=True, text=True, timeout=600)
    if done.returncode not in (0, 1) or "FAILED" not in done.stdout + done.stderr and done.returncode:
        raise RuntimeError(f"promtool failed: {(done.stdout + done.stderr)[-2000:]}")
    fired: dict[str, list[int]] = {a: [] for a in alerts}
    for name, minute in FAILURE.findall(done.stdout + done.stderr):
        fired[name].append(int(minute) + 1)
    return {a: sorted(set(steps)) for a, steps in fired.items()}


def replay_run(run_dir: Path, rules_file: Path) -> dict:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        path = Path(run_dir) / "trainer" / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {"run": str(run_dir), "steps": len({r["step"] for r in rows}), "firing_steps": firing_steps(rows, rules_file)}
