"""Run model-written Python in a sandbox: bubblewrap's view of the interpreter and a scratch tmpfs of `disk_bytes`,
an empty environment, no network, no capabilities, no user namespaces (`shared.envs.isolation`), a seccomp
deny-list (`shared.envs.seccomp`), and limits for the whole call where it gets a cgroup of its own
(`shared.envs.cgroups`); without one, the seccomp program also keeps the code one process. Whatever the code does,
the call ends with a `SandboxResult` naming why, the caller's process untouched; without isolation it is refused
(`reason="no_isolation"`), never run unconfined. docs/security.md: what is and is not held.

Details: docs/internals/inference.md"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from shared.envs import isolation, seccomp
from shared.envs.cgroups import CallGroup

RUNNER_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}  # what the runner and bubblewrap see of an environment
RUNNER = Path(__file__).with_name("sandbox_runner.py")
OPEN_FILES = 32


@dataclass(frozen=True)
class SandboxLimits:
    cpu_seconds: int = 5
    """CPU time of each process (SIGXCPU past it); a call past its wall time that used this much
    CPU in all ends as `cpu_limit`."""
    wall_seconds: float = 10.0
    """Wall time of the call (everything it started is killed past it)."""
    memory_bytes: int = 512 << 20
    """Memory of the call: everything it starts, its scratch files and memfds included (with a
    cgroup; else its one process's address space)."""
    max_processes: int = 16
    """Processes and threads of the call at once (1 where no cgroup can be made)."""
    file_bytes: int = 1 << 20
    """Largest file it may write, its stdout and stderr included."""
    disk_bytes: int = 8 << 20
    """Size of its scratch directory (a tmpfs): all the files it writes together."""


@dataclass(frozen=True)
class SandboxResult:
    # ok | error (exited non-zero) | timeout | cpu_limit | memory | output_limit | disk_limit |
    # killed | no_isolation
    reason: str
    exit_code: int | None
    stdout: str
    stderr: str
    seconds: float
    scope: str = "call"  # what the memory and process limits held for: "call" (a cgroup) or "process"

    @property
    def ok(self) -> bool:
        return self.reason == "ok"


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run `code` as a Python program in the sandbox (its files are gone after the call)."""
    started = time.monotonic()
    refused = isolation.unavailable()
    if refused is not None:
        return SandboxResult("no_isolation", None, "", refused, time.monotonic() - started)
    group = CallGroup.make(limits.memory_bytes, limits.max_processes + 2)  # + bubblewrap's two processes
    filter_fd = None
    work = Path(tempfile.mkdtemp(prefix="steadyrl-sandbox-"))  # never visible inside: code.py alone is bound
    try:
        # without a cgroup to count its processes and memory together, the code stays one process: limits per
        # process are then limits per call
        filter_fd = seccomp.program_fd(seccomp.DENIED if group is not None else seccomp.ONE_PROCESS)
        (work / "code.py").write_text(code)
        inside = {
            "cpu_seconds": limits.cpu_seconds,
            "memory_bytes": limits.memory_bytes,
            "processes": limits.max_processes + 1,  # + bubblewrap's init, the same user
            "file_bytes": limits.file_bytes,
            "open_files": OPEN_FILES,
        }
        python = isolation.interpreter()
        argv = isolation.sandbox_argv(
            work / "code.py",
            {"/.steadyrl/runner.py": RUNNER},
            limits.disk_bytes,
            [python, "-I", "-S", "/.steadyrl/runner.py", "inside", json.dumps(inside)],
            filter_fd,
        )
        outside = {"procs": group.procs if group else [], "argv": argv}
        with open(work / ".stdout", "wb") as out, open(work / ".stderr", "wb") as err:
            runner = subprocess.Popen(
                [python, "-I", str(RUNNER), "outside", json.dumps(outside)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
                pass_fds=(filter_fd,),
                env=RUNNER_ENV,  # bubblewrap, the sandbox's init, keeps its own: none of the caller's
            )
        os.close(filter_fd)
        filter_fd = None
        try:
            status = runner.wait(timeout=limits.wall_seconds)
        except subprocess.TimeoutExpired:
            cpu = _cpu_seconds(group, runner.pid)
            tree = _tree(runner.pid)
            os.killpg(runner.pid, signal.SIGKILL)  # bubblewrap's init dies with it, and its namespace
            runner.wait()
            _wait_gone(tree)
            reason = (
                "memory"
                if group and group.oom_killed()
                else "cpu_limit"
                if cpu is not None and cpu >= limits.cpu_seconds
                else "timeout"
            )
            return _result(reason, None, work, started, group)
        exit_code = 128 - status if status > 128 else status  # bubblewrap: 128 + the signal that ended it
        return _result(_reason(exit_code, work, group), exit_code, work, started, group)
    finally:
        if filter_fd is not None:
            os.close(filter_fd)
        if group is not None:
            group.close()
        for name in ("code.py", ".stdout", ".stderr"):
            (work / name).unlink(missing_ok=True)
        work.rmdir()


def _tree(root: int) -> list[int]:
    """`root` and every process below it, from /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    tree = [root]
    frontier = [root]
    while frontier:
        frontier = [pid for pid, parent in parents.items() if parent in frontier]
        tree += frontier
    return tree


def _cpu_seconds(group: CallGroup | None, root: int) -> float | None:
    """CPU the call used so far: its cgroup's count, else the sum over its live processes (each
    with what its reaped children used)."""
    if group is not None and (seconds := group.cpu_seconds()) is not None:
        return seconds
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in _tree(root):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(f) for f in fields[11:15])  # utime, stime, cutime, cstime
    return total / ticks


def _wait_gone(pids: list[int], seconds: float = 5.0) -> None:
    """Wait (bounded) until none of `pids` runs: the kernel ends a PID namespace's processes once
    its init has died."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        alive = False
        for pid in pids:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            alive = alive or state not in ("Z", "X")
        if not alive:
            return
        time.sleep(0.02)


def _reason(exit_code: int, work: Path, group: CallGroup | None) -> str:
    """Why the code ended: its exit code, or the signal that ended it (negative)."""
    if group is not None and group.oom_killed():
        return "memory"
    if exit_code == 0:
        return "ok"
    if exit_code in (-signal.SIGXCPU, -signal.SIGKILL):  # the soft CPU limit, or the kernel's kill at the hard one
        return "cpu_limit"
    stderr = _read(work / ".stderr")
    if exit_code == -signal.SIGXFSZ or "File too large" in stderr:  # Python ignores SIGXFSZ: writes fail instead
        return "output_limit"
    if "No space left on device" in stderr:
        return "disk_limit"
    if "MemoryError" in stderr or "Cannot allocate memory" in stderr:
        return "memory"
    return "error"


def _read(path: Path, limit: int = 1 << 16) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode(errors="replace")
    except OSError:
        return ""


def _result(reason: str, exit_code: int | None, work: Path, started: float, group: CallGroup | None) -> SandboxResult:
    return SandboxResult(
        reason,
        exit_code,
        _read(work / ".stdout"),
        _read(work / ".stderr"),
        time.monotonic() - started,
        "call" if group is not None else "process",
    )
