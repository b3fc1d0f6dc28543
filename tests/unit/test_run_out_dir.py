"""`steadyrl run --out DIR` where DIR holds a run that ended (its summary.json): refused before anything
starts (exit 2, what to do said), not a 409 from the control plane or a trainer that exits at once."""

import json
import os
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


def test_an_out_directory_in_use_or_not_a_directory_is_refused_and_a_stale_one_is_not(tmp_path):
    import subprocess
    import sys
    import time

    from steadyrl.summary import out_dir_in_use

    (tmp_path / "file").write_text("x")
    assert out_dir_in_use(tmp_path / "file") == f"--out {tmp_path / 'file'} is a file, not a directory"
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "summary.json").write_text("{not json")
    assert "holds a run that ended (its summary.json unreadable)" in out_dir_in_use(corrupt)
    (tmp_path / "odd" / "summary.json").mkdir(parents=True)
    assert "holds a run that ended (its summary.json unreadable)" in out_dir_in_use(tmp_path / "odd")
    live = tmp_path / "live"
    live.mkdir()
    service = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "services.trainer"])
    cmdline = Path(f"/proc/{service.pid}/cmdline")
    deadline = time.monotonic() + 30
    while b"services.trainer" not in cmdline.read_bytes():  # until the child has exec'd its command
        assert time.monotonic() < deadline
        time.sleep(0.01)
    try:
        (live / "pids.json").write_text(json.dumps({"trainer": service.pid, "weightsync": 2**22 + 7}))
        assert (
            out_dir_in_use(live)
            == f"--out {live}: its run is still running (trainer alive): stop it first, or give a new directory"
        )
        (live / "pids.json").write_text(json.dumps({"trainer": os.getpid()}))  # a number reused by another process
        assert out_dir_in_use(live) is None
    finally:
        service.kill()
        service.wait()
    (live / "pids.json").write_text(json.dumps({"trainer": service.pid}))  # the run's processes are gone
    assert out_dir_in_use(live) is None
    assert out_dir_in_use(tmp_path / "new") is None
