"""Running one agent program for one trajectory, as the run's threat model wants it (docs/security.md): an
environment holding only its endpoint, its session key, its prompt and the variables the recipe names; under
bubblewrap (`shared.envs.isolation.agent_argv`) with only the system's files and its own (its interpreter, the
files its command names, the recipe's `read_only_paths`) read-only, in PID and network namespaces of its own where
only its endpoint is reachable (`shared.envs.agent_forwarder`), under the seccomp deny-list, in a cgroup of its own
for memory, processes and CPU (rlimits where none can be made). Its output is kept to a bounded tail; the whole
program is bounded in time."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
from dataclasses import dataclass
from pathlib import Path

from shared.envs import isolation, seccomp
from shared.envs.cgroups import CallGroup

OUTPUT_TAIL = 1 << 20  # bytes of stdout (its last line is the answer) and of stderr kept
FORWARDER = Path(isolation.__file__).with_name("agent_forwarder.py")
RUNNER = Path(isolation.__file__).with_name("sandbox_runner.py")  # its `outside` step joins the cgroup
SOCKET = f"{isolation.AGENT_DIR}/endpoint.sock"


@dataclass(frozen=True)
class AgentIsolation:
    """How agent programs are started on this replica."""

    isolated: bool = True
    hidden: tuple[Path, ...] = ()  # directories (or files' directories) replaced by an empty tmpfs where visible
    tmp_bytes: int = 256 << 20
    passed_env: tuple[str, ...] = ()  # the replica's environment variables an agent also gets
    read_only: tuple[Path, ...] = ()  # the recipe's extra read-only paths
    memory_bytes: int = 2 << 30
    max_processes: int = 64
    cpus: float = 1.0
    endpoint: tuple[Path, int] | None = None  # the replica's endpoint: its unix socket, the port the program dials

    def refused(self) -> str | None:
        """Why no agent program can start here (None when they can)."""
        if not self.isolated:
            return None
        reason = isolation.unavailable()
        return (
            None
            if reason is None
            else f"agent programs run isolated and cannot here: {reason} "
            "(inference.agent.isolation = false runs them without)"
        )

    def environment(self, given: dict[str, str]) -> dict[str, str]:
        """The program's whole environment: the named variables of this replica's, then `given`."""
        return {**{name: os.environ[name] for name in self.passed_env if name in os.environ}, **given}

    def argv(
        self, command: list[str], env: dict[str, str], group: CallGroup | None, seconds: float, seccomp_fd: int | None
    ) -> list[str]:
        """bubblewrap's argv running `command` behind the forwarder, with the rlimits `group` does not hold."""
        cwd = os.getcwd()
        search = env.get("PATH", "/usr/local/bin:/usr/bin:/bin")
        own = [*isolation.program_paths(command, cwd, search), *(p for p in self.read_only if os.path.exists(p))]
        rlimits = {"RLIMIT_CORE": 0}
        if group is None:
            rlimits |= {"RLIMIT_AS": self.memory_bytes, "RLIMIT_NPROC": self.max_processes}
        if group is None or not group.cpu_limited:
            rlimits["RLIMIT_CPU"] = math.ceil(self.cpus * seconds) + 1
        files = {f"{isolation.AGENT_DIR}/forwarder.py": FORWARDER}
        forwarding = {"rlimits": rlimits}
        if self.endpoint is not None:
            files[SOCKET] = self.endpoint[0]
            forwarding |= {"socket": SOCKET, "port": self.endpoint[1]}
        inner = [isolation.interpreter(), "-I", "-S", f"{isolation.AGENT_DIR}/forwarder.py", json.dumps(forwarding)]
        return isolation.agent_argv(
            [*inner, *command],
            env,
            own,
            list(self.hidden),
            self.tmp_bytes,
            files,
            cwd,
            seccomp_fd,
        )


async def run(command: list[str], env: dict[str, str], how: AgentIsolation, seconds: float) -> tuple[int, str, str]:
    """(exit status, stdout's tail, stderr's tail) of `command`; TimeoutError past `seconds`.
    Cancelled or timed out, the program and everything it started are killed (without isolation:
    its process group)."""
    env = how.environment(env)
    if not how.isolated:
        return await _run(command, env, seconds)
    group = CallGroup.make(how.memory_bytes, how.max_processes + 3, how.cpus)  # + bubblewrap's two, the forwarder
    filter_fd = None
    try:
        filter_fd = seccomp.program_fd(seccomp.DENIED)
        argv = how.argv(command, env, group, seconds, filter_fd)
        outside = {"procs": group.procs if group is not None else [], "argv": argv}
        return await _run(
            [isolation.interpreter(), "-I", "-S", str(RUNNER), "outside", json.dumps(outside)],
            {},
            seconds,
            (filter_fd,),
        )
    finally:
        if filter_fd is not None:
            os.close(filter_fd)
        if group is not None:
            group.close()


async def _run(argv: list[str], env: dict[str, str], seconds: float, pass_fds=()) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
        start_new_session=True,
        pass_fds=pass_fds,
    )
    try:
        out, err, status = await asyncio.wait_for(
            asyncio.gather(_tail(process.stdout), _tail(process.stderr), process.wait()), seconds
        )
    except BaseException:
        _kill(process.pid)
        await process.wait()
        raise
    _kill(process.pid)  # what it left behind in its process group (isolated: nothing is left)
    return status, out.decode(errors="replace"), err.decode(errors="replace")


async def _tail(stream: asyncio.StreamReader, limit: int = OUTPUT_TAIL) -> bytes:
    kept = b""
    while chunk := await stream.read(1 << 16):
        kept = (kept + chunk)[-limit:]
    return kept


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
