"""Every Redis key of a run, and every field of its hashes, declared once: who writes it, who reads it.

All keys live under `steadyrl:{run_id}:`. The writer named for a key is its only writer (the
work-queue keys are written only through `shared.runstore.queues` scripts, whichever service calls them).
`markdown_table()` renders the declaration; docs/reference/redis-keys.md prints it (a test keeps them
equal). Hash fields are named by `RunField` and `TrainerField`, whose values are the field names.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


@dataclass(frozen=True)
class Key:
    suffix: str  # after `steadyrl:{run_id}:`
    type: str
    holds: str
    writer: str
    readers: str


KEYS = {
    "tasks": Key(
        "tasks",
        "HASH",
        "task id → PromptTask",
        "queue scripts (submit, lease, complete, dead-letter)",
        "replicas (lease)",
    ),
    "pending": Key("pending", "LIST", "task ids", "queue scripts", "replicas (lease)"),
    "pending_policy": Key(
        "pending:policy",
        "LIST",
        "task ids of π's evals (`evalpi-…`)",
        "queue scripts (submit, requeue route by id)",
        'replicas with `pool = "policy_eval"` (lease)',
    ),
    "leases": Key("leases", "ZSET", "task id → deadline ms", "queue scripts", "orchestrator (sweep)"),
    "owners": Key("owners", "HASH", "task id → replica", "queue scripts", "queue scripts (lease checks, reclaim)"),
    "attempts": Key("attempts", "HASH", "task id → count", "queue scripts", "queue scripts"),
    "errors": Key("errors", "HASH", "task id → last failure", "queue scripts (`fail`)", "queue scripts (requeue)"),
    "completed": Key(
        "completed",
        "HASH",
        "task id → lease stamp",
        "queue scripts (`complete`)",
        "trainer (lease check), replicas (a publish whose reply was lost), orchestrator (depth)",
    ),
    "dead": Key(
        "dead",
        "STREAM",
        "task id, code, reason, task",
        "queue scripts (newest 10,000)",
        "orchestrator (accounting), operators",
    ),
    "dead_counts": Key("dead:counts", "HASH", "code → count", "queue scripts", "orchestrator (`/v1/run`), operators"),
    "rollouts": Key(
        "rollouts", "STREAM", "task, lease, n, r", "queue scripts (`complete`)", "trainer (consumer group `trainer`)"
    ),
    "evals": Key("evals", "STREAM", "task, lease, n, r", "queue scripts (`complete`)", "orchestrator (eval rounds)"),
    "rollouts_dead": Key(
        "rollouts:dead", "STREAM", "entry, reason, message, r", "trainer (newest 10,000)", "operators"
    ),
    "rollouts_dead_counts": Key(
        "rollouts:dead:counts", "HASH", "reason → count", "trainer", "orchestrator (`/v1/run`), operators"
    ),
    "trained": Key("trained", "LIST", "rollout ids (the ledger)", "trainer", "orchestrator (progress), tests"),
    "trained_ids": Key(
        "trained:ids",
        "SET",
        "rollout ids in the ledger, trained, dropped or filtered (guards it)",
        "trainer",
        "trainer",
    ),
    "dropped": Key("trained:dropped", "LIST", "rollout ids dropped as stale", "trainer", "orchestrator (progress)"),
    "filtered": Key(
        "trained:filtered",
        "LIST",
        "rollout ids of groups dynamic sampling filtered (equal rewards)",
        "trainer",
        "orchestrator (progress)",
    ),
    "trained_dead": Key(
        "trained:dead", "SET", "group ids dead-lettered whole", "trainer", "orchestrator (progress), trainer (restart)"
    ),
    "trainer": Key("trainer", "HASH", "`TrainerField`s", "trainer", "trainer (restart)"),
    "run": Key("run", "HASH", "`RunField`s", "orchestrator", "orchestrator, `/v1/run`"),
    "instance": Key(
        "instance",
        "STRING",
        "the run's instance: 32 random hexadecimal characters, written once (SET NX), never changed",
        "the first service of the run to start",
        "trainer (signs it into every version), weight-sync and replicas (refuse another)",
    ),
    "replicas": Key("replicas", "HASH", "replica → version", "orchestrator (heartbeats)", "orchestrator, `/v1/run`"),
    "replica_idle": Key(
        "replica_idle",
        "HASH",
        'replica → "idle seconds,uptime seconds" since it started',
        "orchestrator (heartbeats)",
        "trainer (replica idle share per step)",
    ),
}


class RunField(StrEnum):
    """The fields of the `run` hash (written by the orchestrator)."""

    STATE = "state"  # created | running | paused | stopped | finished | failed
    FAILURE = "failure"  # JSON {rule, reason}: why the run was failed (services/orchestrator/stop_rules.py)
    CREATED_UNIX_MS = "created_unix_ms"  # and `<state>_unix_ms` when each state was entered
    CONFIG = "config"  # the orchestrator's settings as JSON (secrets left out)
    SUBMITTED = "submitted"  # train tasks submitted: the next task number
    EPOCH = "epoch"  # passes over the training set
    AHEAD = "ahead"  # JSON: version → train tasks admitted asking for it, for versions past the trainer's
    DEAD_TRAIN = "dead_train"  # train tasks dead-lettered, folded from `dead`
    DEAD_CURSOR = "dead_cursor"  # the last `dead` entry folded
    EVALS_SUBMITTED = "evals_submitted"  # JSON: the steps whose eval round is queued
    EVAL_VERSIONS = "eval_versions"  # JSON: step → the version it asks for
    EVALS_WRITTEN = "evals_written"  # JSON: μ's rounds written to eval.jsonl
    POLICY_EVALS_WRITTEN = "policy_evals_written"  # JSON: π's rounds written to policy-eval.jsonl
    POLICY_EVAL_INITIAL = "policy_eval_initial"  # JSON: π's first round per eval set
    POLICY_EVAL_RECENT = "policy_eval_recent"  # JSON: π's two latest rounds per eval set


class TrainerField(StrEnum):
    """The fields of the `trainer` hash (written by the trainer)."""

    PUBLISHED_VERSION = "published_version"  # recorded before each push: a restart numbers past it


def check_run_id(run_id: str) -> str:
    """`run_id` when it can name a run's keys and its folders: 1-128 printable characters without
    braces, colons, spaces or slashes, and not "." or ".." (it is a path component of the run's shm
    folder and output directory)."""
    if (
        not run_id
        or len(run_id) > 128
        or run_id in (".", "..")
        or any(c in run_id for c in "{}: /\\")
        or not run_id.isprintable()
    ):
        shown = repr(run_id) if len(run_id) <= 140 else f"{run_id[:40]!r}… ({len(run_id)} characters)"
        raise ValueError(
            f"run_id {shown} must be 1-128 printable characters without braces, colons, spaces or slashes,"
            ' and not "." or ".."'
        )
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
            return self.prefix + KEYS[name].suffix
        except KeyError:
            raise AttributeError(f"no key {name!r} in a run; keys: {sorted(KEYS)}") from None

    def all(self) -> dict[str, str]:
        """Every key by its attribute name (for tests and operators)."""
        return {name: self.prefix + key.suffix for name, key in KEYS.items()}


def markdown_table() -> str:
    """The keys and hash fields of a run as docs/reference/redis-keys.md prints them."""
    lines = ["| key | type | holds | writer | readers |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| `{k.suffix}` | {k.type} | {k.holds} | {k.writer} | {k.readers} |" for k in KEYS.values()]
    for enum in (RunField, TrainerField):
        lines.append("")
        lines.append(f"{enum.__doc__.strip().rstrip('.')}: " + ", ".join(f"`{f.value}`" for f in enum) + ".")
    return "\n".join(lines) + "\n"
