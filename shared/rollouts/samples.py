"""Rollouts from an engine's samples: what a replica publishes for one task's G samples."""

from __future__ import annotations

import numpy as np

from shared.rollouts.record import Rollout, RolloutTimings, trace_message
from shared.rpc.steadyrl.v1 import rollout_pb2


def rollouts_from_samples(
    task, samples, rewards: list[float], replica_id: str, engine: str, timings: RolloutTimings
) -> list[Rollout]:
    """The G rollouts of one PromptTask from the engine's samples (shared.engines.Sample).

    Rollout ids are `task_id:sample_index`: a retried task publishes the same ids, so a consumer
    that dedupes on ids can never count one sample twice."""
    group_id = task.group_id or task.task_id
    prompt = np.asarray(task.prompt_token_ids, dtype=np.int32)
    return [
        Rollout(
            rollout_id=f"{task.task_id}:{index}",
            run_id=task.run_id,
            task_id=task.task_id,
            group_id=group_id,
            sample_index=index,
            group_size=len(samples),
            prompt_token_ids=prompt,
            completion_token_ids=np.asarray(sample.token_ids, dtype=np.int32),
            inference_logprobs=np.asarray(sample.logprobs, dtype=np.float32),
            policy_versions=np.asarray(sample.versions, dtype=np.uint64),
            reward=reward,
            routing_trace=sample.routing_trace,
            num_experts=sample.num_experts,
            finish_reason=sample.finish_reason,
            replica_id=replica_id,
            engine=engine,
            is_eval=task.is_eval,
            timings=timings,
            source=task.source,
        )
        for index, (sample, reward) in enumerate(zip(samples, rewards, strict=True))
    ]


def encode_samples(
    task,
    samples,
    rewards: list[float],
    replica_id: str,
    engine: str,
    timings: RolloutTimings,
    reward_errors: list[str] | None = None,
    reference_rewards: list[float] | None = None,
) -> list[bytes]:
    """`[encode_rollout(r) for r in rollouts_from_samples(...)]` without the Rollout objects, in
    about half the time: what the G rollouts of a task share is serialized once, and each rollout
    is that prefix followed by its own fields (protobuf merges concatenated messages; the two
    parts set disjoint fields, so the decoded rollout is the same)."""
    shared = rollout_pb2.Rollout(
        run_id=task.run_id,
        task_id=task.task_id,
        group_id=task.group_id or task.task_id,
        group_size=len(samples),
        prompt_token_ids=task.prompt_token_ids,
        replica_id=replica_id,
        engine=engine,
        is_eval=task.is_eval,
        timings=rollout_pb2.RolloutTimings(**vars(timings)),
        source=task.source,
    ).SerializeToString()
    out = []
    errors = reward_errors or [""] * len(samples)
    for index, (sample, reward, error) in enumerate(zip(samples, rewards, errors, strict=True)):
        own = rollout_pb2.Rollout(
            rollout_id=f"{task.task_id}:{index}",
            sample_index=index,
            completion_token_ids=sample.token_ids,
            inference_logprobs=sample.logprobs,
            policy_versions=sample.versions,
            reward=float(reward),
            finish_reason=sample.finish_reason,
            reward_error=error[:200],
        )
        if reference_rewards is not None:
            own.reference_reward = float(reference_rewards[index])
        if sample.routing_trace is not None:
            own.routing_trace.CopyFrom(trace_message(sample.routing_trace, sample.num_experts))
        out.append(shared + own.SerializeToString())
    return out


def scored_problem(reasons: list[str], min_scored: int) -> str:
    """Why a training group cannot be trained for its failed rewards ('' when it can): fewer than
    `min_scored` (at most the group's size) of its completions scored (`reasons`: each one's
    reward error, '' where it scored)."""
    scored = sum(not reason for reason in reasons)
    need = min(min_scored, len(reasons))
    if scored >= need:
        return ""
    failed = sorted({reason.split(":")[0] for reason in reasons if reason})
    return f"{scored} of {len(reasons)} rewards scored, {need} needed (failed: {', '.join(failed)})"
