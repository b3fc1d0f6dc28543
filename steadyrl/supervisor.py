"""`steadyrl run` supervises its processes as Kubernetes would: a service, or redis-server, that
exits is restarted on the same port after a backoff (`run.restart_backoff_seconds`, doubled at
each restart of the same process), at most `run.max_restarts` times each; every exit and every
restart is one line (`event=service_exited`, `event=service_restarted`). The services resume
where they were (the trainer from its checkpoint and the stream, replicas from the queue, Redis
from its AOF), so nothing is lost. The trainer exiting 0 has finished its steps: it stays down.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from shared.runtime.jsonl import read_jsonl
from steadyrl.processes import Launch

REDIS = "redis-server"


@dataclass
class Backoff:
    restarts: int = 0
    restart_at: float | None = None  # when a restart is due (monotonic), while one is pending


class GaveUp(RuntimeError):
    """A process used up run.max_restarts: the run fails."""


class Supervisor:
    def __init__(self, launch: Launch, echo: Callable[[str], None] = print) -> None:
        self.launch = launch
        self.echo = echo
        self.backoff: dict[str, Backoff] = {}
        self.finished = False  # the trainer trained the run's last step

    def watched(self) -> Iterator[tuple[str, int | None, Callable[[], int]]]:
        """(name, exit code or None while running, restart → new pid) of every process to watch."""
        launch = self.launch
        if launch.redis is not None and launch.redis.process is not None:
            yield REDIS, launch.redis.process.poll(), lambda: launch.redis.start().process.pid
        for service in launch.services:
            if service.process is None:  # removed on purpose
                continue
            code = service.process.poll()
            if service.name == "trainer" and code == 0 and self.trainer_finished():
                continue

            def restart(service=service) -> int:
                launch.start(service)
                return service.process.pid

            yield service.name, code, restart

    def trainer_finished(self) -> bool:
        """Whether the trainer's last step line is the run's last step (never, with run.steps = 0)."""
        if not self.finished:
            steps = self.launch.config.steps
            lines = read_jsonl(self.launch.out / "trainer" / "metrics.jsonl") if steps else []
            self.finished = bool(lines) and int(lines[-1].get("step", 0)) >= steps
        return self.finished

    def check(self) -> None:
        """One look at every process: schedule a restart for one that exited, start those due.
        Raises GaveUp once a process has used up run.max_restarts."""
        run = self.launch.config.run
        for name, code, restart in list(self.watched()):
            if code is None:
                continue
            state = self.backoff.setdefault(name, Backoff())
            if state.restart_at is None:
                if state.restarts >= run.max_restarts:
                    raise GaveUp(
                        f"{name} exited with {code} after {state.restarts} restarts; see {self.launch.out / 'logs'}"
                    )
                delay = run.restart_backoff_seconds * 2**state.restarts
                state.restart_at = time.monotonic() + delay
                self.echo(
                    f"event=service_exited service={name} code={code} restart_in={delay:.1f}s "
                    f"restarts={state.restarts}/{run.max_restarts}"
                )
            elif time.monotonic() >= state.restart_at:
                state.restarts += 1
                state.restart_at = None
                try:
                    pid = restart()
                except (RuntimeError, TimeoutError) as exc:  # redis-server failed to come up: try again later
                    self.echo(f"event=service_restart_failed service={name} error={exc}")
                    continue
                self.launch.write_pids()
                self.echo(
                    f"event=service_restarted service={name} pid={pid} restarts={state.restarts}/{run.max_restarts}"
                )
