"""What `steadyrl run` shows while a run is on, and when it ends: a live table on a terminal, a
log line every ~5% of the steps and at each eval elsewhere (`progress step=120/400 ...`). It polls
the control plane and the run's files; the supervisor looks at every process on each turn.
"""

from __future__ import annotations

import contextlib
import time

from shared.runtime.jsonl import read_jsonl
from steadyrl.processes import Launch
from steadyrl.supervisor import Supervisor

PROGRESS = ("auto", "rich", "plain", "none")
ENDED = ("finished", "stopped", "failed")  # the run's final states (services/orchestrator/orchestrator.py)


def progress_rows(
    status: dict, metrics: list[dict], evals: list[dict], steps: int, elapsed: float, policy_evals: list[dict] = ()
) -> list[tuple[str, str]]:
    """What the progress shows, as (name, value) pairs. Pure."""
    last = metrics[-1] if metrics else {}
    step = int(last.get("step", 0))
    eta = elapsed / step * (steps - step) if step and steps else None
    return [
        ("step", f"{step}/{steps or '∞'}"),
        ("trainer version", str(status.get("trainer_version", 0))),
        ("replica versions", str(status.get("replica_versions", {}))),
        ("reward", f"{last.get('reward_mean', 0):.3f}"),
        ("mismatch KL (k3)", f"{last.get('mismatch_kl_k3', 0):.2e}"),
        ("staleness peak", str(last.get("staleness_peak", 0))),
        ("tokens/s", f"{last.get('tokens_per_s', 0):.0f}"),
        ("eval accuracy", ", ".join(f"v{e['version']}: {e['accuracy']:.3f}" for e in evals[-4:]) or "-"),
        *(
            [("policy eval", ", ".join(f"v{e['version']}: {e['accuracy']:.3f}" for e in policy_evals[-4:]))]
            if policy_evals
            else []
        ),  # π, the trainer's weights unquantised (orchestrator.evals.policy)
        ("ETA", f"{eta:.0f}s" if eta is not None else "-"),
    ]


def plain_line(rows: list[tuple[str, str]]) -> str:
    """One log line of the progress rows: `step=12/400 trainer_version=12 ...`."""
    return "progress " + " ".join(
        f"{name.replace(' ', '_').replace('(', '').replace(')', '')}={value.replace(' ', '')}"
        for name, value in rows
        if name != "replica versions"
    )


class _PlainProgress:
    """`progress = "plain"`: a line every `every` steps, at each new eval and at the end."""

    def __init__(self, console, steps: int) -> None:
        self.console = console
        self.every = max(1, steps // 20) if steps else 10
        self.next_step = 0
        self.evals = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

    def update(self, rows: list[tuple[str, str]], step: int, evals: int, done: bool) -> None:
        if step >= self.next_step or evals > self.evals or done:
            self.console.print(plain_line(rows), markup=False, highlight=False, soft_wrap=True)
            self.next_step = (step // self.every + 1) * self.every
            self.evals = evals


def watch(launch: Launch, supervisor: Supervisor, console, progress: str) -> dict:
    from rich.live import Live
    from rich.table import Table

    steps = launch.config.steps
    metrics_path = launch.out / "trainer" / "metrics.jsonl"
    begun = time.monotonic()
    if progress == "auto":
        progress = "rich" if console.is_terminal else "plain"

    def render(rows: list[tuple[str, str]], state: str) -> Table:
        table = Table(title=f"{launch.config.run_id}: {state}", show_header=False)
        for name, value in rows:
            table.add_row(name, value)
        return table

    status: dict = {}
    caught_up_wait = 0.0
    replicas = launch.inference_replicas()
    display = (
        Live(render(progress_rows({}, [], [], steps, 0.0), "?"), console=console, refresh_per_second=2)
        if progress == "rich"
        else _PlainProgress(console, steps)
        if progress == "plain"
        else None
    )
    with display or contextlib.nullcontext() as live:
        while True:
            supervisor.check()
            try:
                status = launch.api("GET", "/v1/run")
            except Exception:  # noqa: BLE001 - the control plane may be busy; try again
                time.sleep(0.5)
                continue
            if live is not None:
                metrics = read_jsonl(metrics_path)
                evals = read_jsonl(launch.out / "orchestrator" / "eval.jsonl")
                rows = progress_rows(
                    status,
                    metrics,
                    evals,
                    steps,
                    time.monotonic() - begun,
                    read_jsonl(launch.out / "orchestrator" / "policy-eval.jsonl"),
                )
                if progress == "rich":
                    live.update(render(rows, status.get("state", "?")))
                else:
                    live.update(
                        rows,
                        int(metrics[-1].get("step", 0)) if metrics else 0,
                        len(evals),
                        status.get("state") in ENDED,
                    )
            if status.get("state") == "finished" and not caught_up(status, replicas):
                caught_up_wait = caught_up_wait or time.monotonic()
                if time.monotonic() - caught_up_wait < 15:  # let every replica report the last version
                    time.sleep(0.5)
                    continue
            if status.get("state") in ENDED:
                return status
            # within 5 steps of the last the end is near: asked 5× as often, so the run ends without waiting a poll
            time.sleep(0.1 if steps and steps - status.get("trainer_step", 0) <= 5 else 0.5)


def caught_up(status: dict, replicas: int) -> bool:
    versions = status.get("replica_versions", {})
    return len(versions) >= replicas and all(v >= status.get("trainer_version", 0) for v in versions.values())
