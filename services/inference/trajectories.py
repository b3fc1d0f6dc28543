"""A replica's multi-turn tasks: the task's environment plays each of its G trajectories
(`shared.envs.trajectory.play`), all at once with every other task's sequences in the engine's
continuous batch; the group is sent as G rollouts whose loss masks mark the model's tokens.

An environment that cannot be made, raises, hangs, answers malformed or overflows the budget ends
its trajectory with a reason: the task is dead-lettered with it (a group is trained whole or not
at all) and counted; the replica serves on."""

from __future__ import annotations

import asyncio
import time

import numpy as np
from prometheus_client import Counter, Histogram

from services.inference.agents import PREFIX as AGENT
from services.inference.agents import Endpoint
from services.inference.metrics import TOKENS, TokenRate
from shared.engines import Engine
from shared.envs import make_environment
from shared.envs.trajectory import Budget, Trajectory, TrajectoryError, play
from shared.envs.verifiers_adapter import PREFIX as VERIFIERS
from shared.rollouts.record import RolloutTimings, trace_message
from shared.rollouts.samples import scored_problem
from shared.rpc.steadyrl.v1 import rollout_pb2
from shared.runstore.queues import now_ms

TRAJECTORIES = Counter(
    "steadyrl_inference_trajectories_total",
    "Multi-turn trajectories played, by how they ended (done, max_turns, max_tokens)",
    ["replica", "finish"],
)
TRAJECTORY_FAILURES = Counter(
    "steadyrl_inference_trajectory_failures_total",
    "Multi-turn tasks dead-lettered because a trajectory failed, by reason",
    ["replica", "reason"],
)
TURNS = Histogram(
    "steadyrl_inference_trajectory_turns",
    "Model turns per trajectory",
    ["replica"],
    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32),
)
DEFAULT_TURNS = 4
DEFAULT_ENV_SECONDS = 10.0


def budget_of(task) -> Budget:
    """The task's trajectory budget, the replica's defaults for what it leaves at 0."""
    b = task.budget
    return Budget(
        max_turns=b.max_turns or DEFAULT_TURNS,
        max_tokens=b.max_tokens or task.sampling.max_new_tokens or 16,
        env_seconds=b.env_seconds or DEFAULT_ENV_SECONDS,
    )


def _served(endpoint: Endpoint | None) -> Endpoint:
    if endpoint is None:
        raise TrajectoryError(
            "env_error", "agent and verifiers tasks need the replica's OpenAI endpoint (inference.agent.endpoint)"
        )
    return endpoint


def _environment(name: str):
    try:
        return make_environment(name)
    except Exception as exc:  # noqa: BLE001 - a plug-in that fails to build ends the task, named
        raise TrajectoryError(
            "env_error", f"environment {name!r} could not be made: {type(exc).__name__}: {exc}"
        ) from None


async def play_group(
    engine: Engine,
    tokenizer,
    checked,
    return_traces: bool,
    replica_id: str,
    run_id: str,
    leased_ms: int,
    rate: TokenRate,
    min_scored: int = 2,
    endpoint: Endpoint | None = None,
) -> list[bytes]:
    """The task's G rollouts, their model tokens counted (TrajectoryError: the first trajectory
    that failed, the others cancelled; `reward_failed`: a training group with fewer than
    `min_scored` rewards that scored). `endpoint`: the replica's agent endpoint, which agent and
    verifiers tasks play through."""
    task = checked.lease.task
    started_ms = now_ms()
    started = time.perf_counter()
    text = task.prompt_text or tokenizer.decode(checked.prompt, skip_special_tokens=True)
    record = {"prompt": text, "answer": task.answer, "task_id": task.task_id, "is_eval": task.is_eval}
    budget = budget_of(task)
    plays: list[asyncio.Future] = []
    try:
        if task.environment.startswith(VERIFIERS):  # the environment's rollout loop drives the engine
            plays.append(
                asyncio.ensure_future(_served(endpoint).play_verifiers(task, checked.sampling, budget, return_traces))
            )
        for i in range(0 if plays else task.group_size):
            if task.environment.startswith(AGENT):  # an agent program drives the engine itself
                playing = _served(endpoint).play(task, text, checked.sampling, budget, return_traces, i)
            else:
                playing = play(
                    engine,
                    tokenizer,
                    _environment(task.environment),
                    record,
                    checked.sampling,
                    budget,
                    return_traces,
                    index=i,
                )
            plays.append(asyncio.ensure_future(playing))
        done = await asyncio.gather(*plays)
        trajectories = done[0] if task.environment.startswith(VERIFIERS) else done
    except BaseException as exc:
        for p in plays:
            p.cancel()
        await asyncio.gather(*plays, return_exceptions=True)
        if isinstance(exc, TrajectoryError):
            TRAJECTORY_FAILURES.labels(replica_id, exc.code).inc()
        raise
    problem = "" if task.is_eval else scored_problem([t.reward_error for t in trajectories], min_scored)
    if problem:
        raise TrajectoryError("reward_failed", problem)
    for t in trajectories:
        TRAJECTORIES.labels(replica_id, t.finish_reason).inc()
        TURNS.labels(replica_id).observe(t.turns)
    tokens = sum(sum(t.loss_mask) for t in trajectories)
    TOKENS.labels(replica_id).inc(tokens)
    rate.add(tokens)
    task.run_id = task.run_id or run_id
    timings = RolloutTimings(leased_ms, started_ms, now_ms(), time.perf_counter() - started)
    return encode_trajectories(task, trajectories, replica_id, engine.name, timings)


def encode_trajectories(
    task, trajectories: list[Trajectory], replica_id: str, engine: str, timings: RolloutTimings
) -> list[bytes]:
    """The G rollouts of a multi-turn task (ids `task_id:index`, like single-turn ones)."""
    out = []
    for index, t in enumerate(trajectories):
        arrays = t.arrays()
        msg = rollout_pb2.Rollout(
            rollout_id=f"{task.task_id}:{index}",
            run_id=task.run_id,
            task_id=task.task_id,
            group_id=task.group_id or task.task_id,
            sample_index=index,
            group_size=len(trajectories),
            prompt_token_ids=t.prompt_token_ids,
            completion_token_ids=arrays["completion_token_ids"].tolist(),
            inference_logprobs=arrays["inference_logprobs"].tolist(),
            policy_versions=t.versions,
            loss_mask=t.loss_mask,
            reward=float(t.reward),
            finish_reason=t.finish_reason,
            replica_id=replica_id,
            engine=engine,
            is_eval=task.is_eval,
            turns=t.turns,
            env_metrics=t.env_metrics,
            reward_error=t.reward_error,
            timings=rollout_pb2.RolloutTimings(**vars(timings)),
            source=task.source,
        )
        if t.routing_trace is not None:
            msg.routing_trace.CopyFrom(trace_message(np.asarray(t.routing_trace), t.num_experts))
        out.append(msg.SerializeToString())
    return out
