"""Every Redis key of a run, in one place: who writes it, who reads it.

All keys live under `steadyrl:{run_id}:`. The writer named for a key is its only writer (the
work-queue keys are written only through `shared.queues` scripts, whichever service calls them).

| key                     | type   | writer                      | readers                 |
| ----------------------- | ------ | --------------------------- | ----------------------- |
| `tasks`                 | HASH   | queue scripts               | replicas (lease)        |
| `pending`               | LIST   | queue scripts               | replicas (lease)        |
| `pending:policy`        | LIST   | queue scripts               | policy-eval replicas    |
| `leases`                | ZSET   | queue scripts               | orchestrator (sweep)    |
| `owners`                | HASH   | queue scripts               | queue scripts           |
| `attempts`              | HASH   | queue scripts               | queue scripts           |
| `errors`                | HASH   | queue scripts (`fail`)      | queue scripts (requeue) |
| `completed`             | HASH   | queue scripts (`complete`)  | trainer (lease check)   |
| `dead`                  | STREAM | queue scripts               | orchestrator, operators |
| `dead:counts`           | HASH   | queue scripts               | orchestrator, operators |
| `rollouts`              | STREAM | queue scripts (`complete`)  | trainer (consumer group)|
| `evals`                 | STREAM | queue scripts (`complete`)  | orchestrator            |
| `rollouts:dead`         | STREAM | trainer                     | operators               |
| `rollouts:dead:counts`  | HASH   | trainer                     | orchestrator, operators |
| `trained`               | LIST   | trainer                     | orchestrator (ledger)   |
| `trained:ids`           | SET    | trainer                     | trainer                 |
| `trained:dropped`       | LIST   | trainer                     | orchestrator (ledger)   |
| `trained:dead`          | SET    | trainer                     | orchestrator (ledger)   |
| `trainer`               | HASH   | trainer                     | trainer (restart)       |
| `run`                   | HASH   | orchestrator                | orchestrator, `/v1/run` |
| `replicas`              | HASH   | orchestrator (heartbeats)   | orchestrator, `/v1/run` |
"""

from __future__ import annotations

from dataclasses import dataclass

_NAMES = {
    "tasks": "tasks", "pending": "pending", "pending_policy": "pending:policy", "leases": "leases", "owners": "owners",
    "attempts": "attempts",
    "errors": "errors", "completed": "completed", "dead": "dead", "dead_counts": "dead:counts",
    "rollouts": "rollouts", "evals": "evals", "rollouts_dead": "rollouts:dead",
    "rollouts_dead_counts": "rollouts:dead:counts", "trained": "trained", "trained_ids": "trained:ids",
    "dropped": "trained:dropped", "trained_dead": "trained:dead", "trainer": "trainer", "run": "run",
    "replicas": "replicas",
}


def check_run_id(run_id: str) -> str:
    if not run_id or any(c in run_id for c in "{}: ") or len(run_id) > 128:
        raise ValueError(f"run_id {run_id!r} must be 1-128 characters without braces, colons or spaces")
    return run_id


@dataclass(frozen=True)
class RunKeys:
    """The keys of one run. `RunKeys("demo").rollouts == "steadyrl:demo:rollouts"`."""

    run_id: str

    def __post_init__(self) -> None:
        check_run_id(self.run_id)

    @property
    def prefix(self) -> str:
        return f"steadyrl:{self.run_id}:"

    def __getattr__(self, name: str) -> str:
        try:
            return self.prefix + _NAMES[name]
        except KeyError:
            raise AttributeError(f"no key {name!r} in a run; keys: {sorted(_NAMES)}") from None

    def all(self) -> dict[str, str]:
        """Every key by its attribute name (for tests and operators)."""
        return {name: self.prefix + suffix for name, suffix in _NAMES.items()}
