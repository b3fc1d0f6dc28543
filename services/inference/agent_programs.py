"""Running one agent program for one trajectory, as the run's threat model wants it
(docs/security.md): an environment holding only its endpoint, its session key, its prompt and the
variables the recipe names; under bubblewrap (`shared.envs.isolation.agent_argv`) in a PID
namespace of its own, so it sees no other process and everything it starts ends with it, the
host read-only, its own /tmp, the run's secret directories hidden. Its output is kept to a bounded
tail; the whole program is bounded in time."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from dataclasses import dataclass
from pathlib import Path

from shared.envs import isolation

OUTPUT_TAIL = 1 << 20  # bytes of stdout (its last line is the answer) and of stderr kept


@dataclass(frozen=True)
class AgentIsolation:
    """How agent programs are started on this replica."""

    isolated: bool = True
    hidden: tuple[Path, ...] = ()  # directories (or files' directories) replaced by an empty tmpfs
    tmp_bytes: int = 256 << 20
    passed_env: tuple[str, ...] = ()  # the replica's environment variables an agent also gets

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

    def argv(self, command: list[str], env: dict[str, str]) -> list[str]:
        if not self.isolated:
            return command
        return isolation.agent_argv(command, env, list(self.hidden), self.tmp_bytes)


async def run(command: list[str], env: dict[str, str], how: AgentIsolation, seconds: float) -> tuple[int, str, str]:
    """(exit status, stdout's tail, stderr's tail) of `command`; TimeoutError past `seconds`.
    Cancelled or timed out, the program and everything it started are killed (without isolation:
    its process group)."""
    env = how.environment(env)
    process = await asyncio.create_subprocess_exec(
        *how.argv(command, env),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={} if how.isolated else env,
        start_new_session=True,
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
