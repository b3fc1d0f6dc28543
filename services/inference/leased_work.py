"""A replica's leased work (tasks leased from the run's work queue; reward tasks are `shared.tasks`): what it
checks before it serves a lease, and the renewal of the leases it holds."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Collection
from dataclasses import dataclass

import redis.exceptions
from prometheus_client import Counter

from services.inference.agents import PREFIX as AGENT
from services.inference.judge import JudgeScoring
from shared.engines import Engine, Sampling
from shared.envs import environment_factory, verifiers_adapter
from shared.envs.trajectory import render
from shared.envs.verifiers_adapter import PREFIX as VERIFIERS
from shared.runstore.queues import Lease, WorkQueue
from shared.tasks import RewardRunner
from shared.tasks.judging import model_reward
from shared.tasks.reward_contract import Row

log = logging.getLogger("steadyrl.inference.worker")
MAX_GROUP_SIZE = 4096
RENEW_ERRORS = Counter(
    "steadyrl_inference_lease_renew_errors_total", "Lease renewals Redis refused or timed out", ["replica"]
)


class Unservable(ValueError):
    """A leased task that can never be served here: a reason code and its message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def prompt_ids(task, tokenizer) -> list[int]:
    if task.prompt_token_ids:
        return list(task.prompt_token_ids)
    if not task.prompt_text:
        raise Unservable("prompt", f"task {task.task_id} has neither prompt_token_ids nor prompt_text")
    if task.environment.startswith(VERIFIERS):  # its dataset row: what counts is the opening messages
        try:
            return render(tokenizer, [], verifiers_adapter.prompt_messages(task.prompt_text))
        except ValueError as exc:
            raise Unservable("prompt", str(exc)) from None
    return list(tokenizer(task.prompt_text).input_ids)


@dataclass
class Checked:
    """A lease that passed `check_lease`: its prompt's tokens and its sampling."""

    lease: Lease
    prompt: list[int]
    sampling: Sampling


def undeclared_plugin(task, declared: Collection[str]) -> str | None:
    """The plug-in the task names (a `module:function` reward, a `module:factory`, `agent:` or
    `verifiers:` environment) that the run did not declare, None when all it names is built in or
    declared. Checked before anything is imported or run: a task in Redis can be forged. Pure."""
    if ":" in task.task_name and model_reward(task.task_name) is None and task.task_name not in declared:
        return task.task_name
    if ":" in task.environment and task.environment not in declared:
        return task.environment
    return None


def check_lease(
    lease: Lease,
    run_id: str,
    engine: Engine,
    tokenizer,
    rewards: RewardRunner,
    judging: JudgeScoring | None = None,
    declared: Collection[str] = (),
) -> Checked:
    """The leased task's prompt and sampling, or Unservable when it can never be served here (`judging`:
    the judge pool's client, which alone scores `judge:` and `reward_model:` rewards; `declared`: the
    plug-ins the run names, inference.plugins)."""
    task = lease.task
    if task.run_id and task.run_id != run_id:
        raise Unservable("other_run", f"task of run {task.run_id!r} in the queue of {run_id!r}")
    if (plugin := undeclared_plugin(task, declared)) is not None:
        raise Unservable(
            "undeclared", f"{plugin[:200]!r} is no reward or environment this run declares (inference.plugins)"
        )
    if not 1 <= task.group_size <= MAX_GROUP_SIZE:
        raise Unservable("group_size", f"group_size {task.group_size} outside [1, {MAX_GROUP_SIZE}]")
    try:
        sampling = Sampling.from_proto(task.sampling)
    except ValueError as exc:
        raise Unservable("sampling", str(exc)) from None
    refused = getattr(engine, "refused_sampling", lambda _: None)(sampling)  # exact mode's
    if refused is not None:
        raise Unservable("sampling", refused)
    prompt = prompt_ids(task, tokenizer)
    if not prompt or min(prompt) < 0 or max(prompt) >= engine.vocab_size:
        raise Unservable("prompt", f"prompt token ids outside the vocabulary [0, {engine.vocab_size})")
    completion = max(sampling.max_new_tokens, task.budget.max_tokens) if task.environment else sampling.max_new_tokens
    if len(prompt) + completion > engine.max_model_len:
        raise Unservable(
            "context",
            f"prompt ({len(prompt)}) + {'the trajectory budget' if task.environment else 'max_new_tokens'}"
            f" ({completion}) > the engine's {engine.max_model_len} positions",
        )
    overlong = task.overlong
    if overlong.buffer_tokens and not (
        overlong.buffer_tokens < sampling.max_new_tokens and 0 <= overlong.penalty <= 100 and not task.environment
    ):
        raise Unservable(
            "overlong",
            f"overlong shaping of {overlong.buffer_tokens} tokens, penalty {overlong.penalty}: needs a buffer under "
            f"max_new_tokens ({sampling.max_new_tokens}), a penalty in [0, 100] and a single-turn task",
        )
    try:
        Row.from_json(task.reward_row)  # untrusted: bounded, JSON values only
    except ValueError as exc:
        raise Unservable("reward_row", str(exc)) from None
    agent = task.environment.startswith(AGENT)
    if agent and not task.environment[len(AGENT) :].strip():
        raise Unservable("environment", "an agent environment names its command: agent:COMMAND")
    if task.environment.startswith(VERIFIERS):
        try:
            verifiers_adapter.load(task.environment)  # imported once per replica and name, then cached
        except ValueError as exc:
            raise Unservable("environment", str(exc)) from None
        return Checked(lease, prompt, sampling)
    if model_reward(task.task_name) is not None:
        if task.environment:
            raise Unservable("reward", f"{task.task_name!r}: a model-judged reward scores single-turn tasks only")
        try:
            (judging or JudgeScoring(None, {}, rewards)).check(task.task_name)
        except KeyError as exc:
            raise Unservable("reward", str(exc.args[0] if exc.args else exc)) from None
        return Checked(lease, prompt, sampling)
    try:
        environment_factory(task.environment) if task.environment and not agent else rewards.check(task.task_name)
    except KeyError as exc:
        raise Unservable("environment" if task.environment and not agent else "reward", str(exc)) from None
    return Checked(lease, prompt, sampling)


class LeaseRenewal:
    """Renews the leases a replica holds until stopped. Stopping empties what it renews first, so
    even a renewal stuck in a Redis call that outlives its cancellation renews nothing after."""

    def __init__(self, queue: WorkQueue, replica_id: str, lease_seconds: float, held: set[str]) -> None:
        self.queue = queue
        self.replica_id = replica_id
        self.lease_seconds = lease_seconds
        self.held = held
        self.done = asyncio.Event()
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while not self.done.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.done.wait(), self.lease_seconds / 3)
            if self.done.is_set():
                return
            try:
                await self.queue.extend(self.replica_id, sorted(self.held), self.lease_seconds)
            except redis.exceptions.RedisError as exc:
                RENEW_ERRORS.labels(self.replica_id).inc()
                log.warning("event=lease_renew_failed error=%s", type(exc).__name__)

    async def stop(self) -> None:
        self.done.set()
        self.held.clear()
        self.task.cancel()
        await asyncio.wait({self.task}, timeout=1.0)  # never waits on a call that ignores its cancel
