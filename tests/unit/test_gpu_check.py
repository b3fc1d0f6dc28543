"""scripts/gpu-check on a machine without a GPU (where it has one, it runs for real: see docs/guides/gpus.md)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch


@pytest.mark.process  # starts a steadyrl process: not in the fast tier
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: scripts/gpu-check runs for real")
def test_gpu_check_says_so_on_a_machine_without_a_gpu(tmp_path):
    """The GPU check script parses, and where no CUDA device is visible it stops at once, saying so."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "gpu-check"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    done = subprocess.run(
        [str(script), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable},
    )
    assert done.returncode == 1 and "no CUDA device visible" in done.stderr
    assert not list((tmp_path / "out").iterdir())  # nothing ran
