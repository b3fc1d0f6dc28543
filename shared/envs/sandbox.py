"""Run model-written Python in a sandbox: a separate process with no network, file writes
confined to a scratch directory, and limits on CPU seconds, memory, processes, output and wall
time (`shared/envs/sandbox_runner.py` does the isolating). Whatever the code does — connect out,
write outside, fork without end, loop forever, allocate without end — the call ends with a
`SandboxResult` naming why, the caller's process untouched. Where the kernel refuses user,
network and PID namespaces or Landlock, the call is refused (`reason="no_isolation"`), never run
unconfined.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

RUNNER = Path(__file__).with_name("sandbox_runner.py")
REFUSED = 3  # the runner's exit code when it cannot isolate


@dataclass(frozen=True)
class SandboxLimits:
    cpu_seconds: int = 5
    """CPU time of the code (SIGXCPU past it)."""
    wall_seconds: float = 10.0
    """Wall time of the call (everything it started is killed past it)."""
    memory_bytes: int = 512 << 20
    """Address space of each process."""
    max_processes: int = 16
    """Processes and threads at once (counted in the sandbox's own user namespace)."""
    file_bytes: int = 1 << 20
    """Largest file it may write, its stdout and stderr included."""


@dataclass(frozen=True)
class SandboxResult:
    reason: str  # ok | error (exited non-zero) | timeout | cpu_limit | memory | output_limit | killed | no_isolation
    exit_code: int | None
    stdout: str
    stderr: str
    seconds: float

    @property
    def ok(self) -> bool:
        return self.reason == "ok"


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run `code` as a Python program in the sandbox, in a fresh scratch directory (removed after)."""
    started = time.monotonic()
    scratch = Path(tempfile.mkdtemp(prefix="steadyrl-sandbox-"))
    try:
        (scratch / "code.py").write_text(code)
        config = {"scratch": str(scratch), **{k: v for k, v in asdict(limits).items() if k != "wall_seconds"}}
        runner = subprocess.Popen([sys.executable, "-I", str(RUNNER), json.dumps(config)], stdin=subprocess.DEVNULL,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        try:
            out, err = runner.communicate(timeout=limits.wall_seconds)
        except subprocess.TimeoutExpired:
            os.killpg(runner.pid, signal.SIGKILL)  # the code is PID 1 of its namespace: it and all it started die
            out, _ = runner.communicate()
            _wait_gone(_report(out, "child").get("child"))
            return _result("timeout", None, scratch, started)
        report = _report(out, "exit") or _report(out, "refused")
        if runner.returncode == REFUSED or "refused" in report:
            return SandboxResult("no_isolation", None, "", report.get("refused", err.decode(errors="replace")),
                                 time.monotonic() - started)
        exit_code = report.get("exit")
        return _result(_reason(exit_code, scratch), exit_code, scratch, started)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _report(out: bytes, key: str = "") -> dict:
    """The runner's last JSON line (the one holding `key`, when given)."""
    for line in reversed(out.decode(errors="replace").splitlines()):
        try:
            report = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not key or key in report:
            return report
    return {}


def _wait_gone(pid: int | None, seconds: float = 5.0) -> None:
    """Wait (bounded) for the code's PID 1 to be gone: the kernel lets it go once every process of
    its namespace has exited."""
    deadline = time.monotonic() + seconds
    while pid and time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return
        if state in ("Z", "X"):
            return
        time.sleep(0.02)


def _reason(exit_code: int | None, scratch: Path) -> str:
    """Why the code ended: its exit code, or the signal that ended it (negative)."""
    if exit_code is None:
        return "killed"
    if exit_code == 0:
        return "ok"
    if exit_code in (-signal.SIGXCPU, -signal.SIGKILL):  # the soft CPU limit, or the kernel's kill at the hard one
        return "cpu_limit"
    stderr = _read(scratch / ".stderr")
    if exit_code == -signal.SIGXFSZ or "File too large" in stderr:  # Python ignores SIGXFSZ: writes fail instead
        return "output_limit"
    if "MemoryError" in stderr:
        return "memory"
    return "error"


def _read(path: Path, limit: int = 1 << 16) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode(errors="replace")
    except OSError:
        return ""


def _result(reason: str, exit_code: int | None, scratch: Path, started: float) -> SandboxResult:
    return SandboxResult(reason, exit_code, _read(scratch / ".stdout"), _read(scratch / ".stderr"),
                         time.monotonic() - started)
