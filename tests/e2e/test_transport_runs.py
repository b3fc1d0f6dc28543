"""The tiny demo learns on every weight transport, as it does on gRPC."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


# slow: the collective transport runs a whole run in tests/chaos/test_weight_collective.py, grpc crosses
# a replica and weight-sync in tests/integration/test_weight_transports.py; shm, `steadyrl run`'s
# default on one host, in test_run.py
@pytest.mark.parametrize("transport", [pytest.param(t, marks=pytest.mark.slow) for t in ("grpc", "collective")])
def test_the_demo_learns_with_weights_on(tmp_path, tiny_model_dir, transport):
    out = tmp_path / "run"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "steadyrl.cli",
            "run",
            str(ROOT / "configs" / "tiny-arith.toml"),
            "--out",
            str(out),
            "--set",
            "run.steps=120",
            "--set",
            "orchestrator.evals.every=120",
            "--set",
            "orchestrator.evals.size=300",
            "--set",
            f"trainer.publish.transport={transport}",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    print(f"{transport}: eval {summary['eval_start']:.3f} → {summary['eval_end']:.3f} in {summary['wall_seconds']} s")
    assert summary["outcome"] == "finished" and summary["eval_end"] - summary["eval_start"] >= 0.10
    published = (out / "logs" / "weightsync.log").read_text().count(f"transport={transport}")
    assert published >= 100  # the versions went this way (not by a fallback)
    assert set(summary["final_status"]["replica_versions"].values()) == {120}
