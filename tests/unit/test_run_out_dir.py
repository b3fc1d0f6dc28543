"""`steadyrl run --out DIR` where DIR holds a run that ended (its summary.json): refused before anything
starts (exit 2, what to do said), not a 409 from the control plane or a trainer that exits at once."""

import json
from pathlib import Path

from typer.testing import CliRunner

from steadyrl.cli import app

RECIPE = str(Path(__file__).resolve().parents[2] / "configs" / "tiny-arith.toml")


def test_an_out_directory_of_a_run_that_ended_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr("steadyrl.service_settings.check", lambda recipe: {"trainer": _Trainer()})
    (tmp_path / "summary.json").write_text(json.dumps({"outcome": "finished"}))
    refused = CliRunner().invoke(app, ["run", RECIPE, "--out", str(tmp_path), "--set", "run.steps=2"])
    assert refused.exit_code == 2
    assert f"--out {tmp_path} holds a run that ended (finished): give a new directory" in refused.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]  # nothing started, nothing written


class _Trainer:
    class parallel:  # noqa: N801 - the shape of TrainerSettings.parallel the command reads
        nodes = 1
