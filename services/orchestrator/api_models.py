"""The bodies and statuses of the orchestrator's HTTP control plane, as its OpenAPI schema declares them.

The routes send dicts; these types declare their shape (pydantic validates each reply against them, and a key the
code sends that is not declared here fails the reply). A key absent until it applies is `NotRequired`, never null.

Details: docs/internals/orchestrator.md"""

from __future__ import annotations

from typing import Any, Literal, NotRequired

from pydantic import ConfigDict, RootModel
from typing_extensions import TypedDict  # pydantic needs this one before Python 3.12

DECLARED = ConfigDict(extra="forbid", use_attribute_docstrings=True)

RunState = Literal["created", "running", "paused", "stopped", "finished", "failed"]
Action = Literal["start", "pause", "resume", "stop"]
Transitioned = Literal["running", "paused", "stopped"]  # where the actions lead (orchestrator.TRANSITIONS)


class Progress(TypedDict):
    """Train prompts so far (each a group of `run.group_size` rollouts)."""

    __pydantic_config__ = DECLARED
    submitted: int
    """Train prompt tasks queued."""
    trained: int
    """Prompts trained: `run.batch_prompts` per trainer step (the ledger lags until the trainer's next checkpoint)."""
    dropped: int
    """Prompts whose group the trainer dropped as staler than `run.max_staleness`."""
    filtered: int
    """Prompts whose group dynamic sampling filtered (equal rewards)."""
    dead: int
    """Prompts given up: dead-lettered by the queue or by the trainer."""


class QueueDepths(TypedDict):
    """The work queue's lengths (its Redis keys)."""

    __pydantic_config__ = DECLARED
    pending: int
    """Tasks waiting for a replica of the rollouts pool (μ's eval tasks among them)."""
    leased: int
    """Tasks a replica of the rollouts pool holds now (μ's eval tasks among them)."""
    completed: int
    """Tasks completed (their lease stamps, which the trainer checks)."""
    dead: int
    """Entries of the task dead-letter stream (it keeps the newest 10,000)."""
    rollouts: int
    """Entries of the rollout stream."""
    pending_policy: int
    """Tasks waiting for a replica of the `policy_eval` pool (π's evals)."""
    leased_policy: int
    """Tasks a replica of the `policy_eval` pool holds now."""
    pending_eval: int
    """Of `pending`: μ's eval tasks (the rest is training work)."""
    leased_eval: int
    """Of `leased`: μ's eval tasks."""


class DeadLetters(TypedDict):
    """Dead letters since the run began, by reason code."""

    __pydantic_config__ = DECLARED
    tasks: dict[str, int]
    """Tasks the queue gave up, by reason (`decode`, `attempts`, `reward`...)."""
    rollouts: dict[str, int]
    """Rollouts the trainer dead-lettered, by reason (`oversize`, `group_poisoned`...)."""


class Staleness(TypedDict, total=False):
    """From the trainer's last metrics: each key once the trainer has reported it."""

    __pydantic_config__ = DECLARED
    staleness_mean: float
    """Mean versions between the trainer and each token's sampler, in the last step."""
    staleness_peak: float
    """Most versions any token of the last step was behind."""
    dropped_stale: float
    """Rollouts dropped as stale since the run started."""


class Failure(TypedDict):
    """Why a stop rule failed the run."""

    __pydantic_config__ = DECLARED
    rule: str
    """The stop rule: `stalled`, `dead_share` or `reward_failures` (`orchestrator.stop`)."""
    reason: str
    """What it saw, in words."""


class Stale(TypedDict):
    """When the status was read and why Redis did not answer now."""

    __pydantic_config__ = DECLARED
    read_unix_ms: int
    """When this status was read (Unix time, milliseconds)."""
    reason: str
    """Why Redis did not answer within `orchestrator.control.timeout_seconds` (e.g. `TimeoutError`)."""
    age_seconds: float
    """Seconds since it was read."""


class RunStatus(TypedDict):
    """The run's status: its state, the trainer's and every replica's version, the queue, progress and evals."""

    __pydantic_config__ = DECLARED
    run_id: str
    """The run's id."""
    state: RunState
    """created → running ⇄ paused → finished; `stop` from the first three, `failed` by a stop rule. `stopped`,
    `finished` and `failed` are final."""
    trainer_version: int
    """The policy version the trainer published last (from its Status; else counted from its ledger)."""
    trainer_step: int
    """The trainer's global steps so far."""
    replica_versions: dict[str, int]
    """The policy version each inference replica reported in its last heartbeat, by replica id."""
    progress: Progress
    """Train prompts submitted, trained, dropped, filtered and dead."""
    queue: QueueDepths
    """The work queue's depths."""
    dead_letters: DeadLetters
    """Dead-lettered tasks and rollouts by reason."""
    epoch: int
    """Whole passes over the training examples among the tasks submitted."""
    staleness: Staleness
    """The trainer's staleness figures (empty until it reports them)."""
    last_metrics: dict[str, float]
    """The trainer's metrics of its last step, by name (empty until it reports them)."""
    evals: dict[str, float]
    """μ's accuracy on the main eval set, by the trainer step of the round."""
    failure: NotRequired[Failure]
    """Present when the run is `failed`: the stop rule and its reason."""
    policy_evals: NotRequired[dict[str, float]]
    """Present with `orchestrator.evals.policy`: π's accuracy on the main eval set, by step."""
    stale: NotRequired[Stale]
    """Present when Redis did not answer in time: this is the last status read, and this says when and why."""


class ActionReply(TypedDict):
    """The run's state after the transition."""

    __pydantic_config__ = DECLARED
    run_id: str
    """The run's id."""
    state: Transitioned
    """The state the transition put the run in."""


class RunConfig(RootModel[dict[str, Any]]):
    """The orchestrator's resolved settings, as in the settings reference (a free-form object: its keys are
    the `orchestrator` settings), secrets left out (`token`, `token_file`, `redis_url`)."""


class Health(TypedDict):
    """The process is up (it says nothing of Redis)."""

    __pydantic_config__ = DECLARED
    ok: bool
    """Always true."""


class Error(TypedDict):
    """An error: every refusal is JSON."""

    __pydantic_config__ = DECLARED
    detail: str
    """What was refused, and why."""


class Unavailable(TypedDict):
    """Redis did not answer in time; nothing was applied."""

    __pydantic_config__ = DECLARED
    detail: str
    """What was refused, and why."""
    retry_after_seconds: int
    """When to try again (also the `Retry-After` header): twice `orchestrator.control.timeout_seconds`, rounded
    up."""


def refusal(model: type, description: str, headers: dict[str, dict] | None = None) -> dict[str, Any]:
    """One status's entry of a route's `responses`: its body, when it happens, and its headers."""
    return {"model": model, "description": description, **({"headers": headers} if headers else {})}


TOO_LARGE = refusal(
    Error,
    "The request's body is over `orchestrator.control.max_request_bytes` (refused before the route runs, on every "
    "route).",
)
UNAUTHORISED = refusal(
    Error,
    "No bearer token, or a wrong one (when the orchestrator has a token).",
    {"WWW-Authenticate": {"description": "`Bearer`", "schema": {"type": "string"}}},
)


def unavailable(when: str) -> dict[str, Any]:
    """A 503's entry: Redis did not answer within `orchestrator.control.timeout_seconds`, `when`..."""
    retry = {"description": "Seconds to wait: `retry_after_seconds`.", "schema": {"type": "integer"}}
    return refusal(Unavailable, when, {"Retry-After": retry})
