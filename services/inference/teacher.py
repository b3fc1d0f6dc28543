"""A rollout replica's side of on-policy distillation: each finished group is sent to the teacher
pool, which scores every completion token given the same context (a prefill), and the teacher's
logprobs (with `top_k`, its k most likely tokens at each position too) ride on the rollouts to the
trainer. A pool that is down, slow or answers garbage fails the
call after its bounded attempts (`PoolError`): the worker hands the task back, and the queue retries
it and, past its attempts, dead-letters it with the reason.

Details: docs/guides/pools.md"""

from __future__ import annotations

import math

import numpy as np

from shared.rollouts.record import decode_rollout, encode_rollout
from shared.rpc.pool_client import PoolClient
from shared.rpc.steadyrl.v1 import inference_pb2 as pb


def score_request(payloads: list[bytes], top_k: int = 0) -> tuple[pb.ScoreRequest, list]:
    """The request for these encoded rollouts (each its prompt and completion) and the rollouts."""
    rollouts = [decode_rollout(p) for p in payloads]
    request = pb.ScoreRequest(
        sequences=[
            pb.ScoreSequence(
                prompt_token_ids=r.prompt_token_ids.tolist(), completion_token_ids=r.completion_token_ids.tolist()
            )
            for r in rollouts
        ],
        top_k=top_k,
    )
    return request, rollouts


def reply_problem(reply: pb.ScoreReply, lengths: list[int], top_k: int = 0) -> str:
    """Why a teacher's reply cannot be used ('' when it can): one logprob per completion token of
    every sequence, each finite and at most 0; with `top_k`, k ids (≥ 0) and k such logprobs per
    completion token."""
    if len(reply.sequences) != len(lengths):
        return f"{len(reply.sequences)} sequences scored, {len(lengths)} sent"
    for i, (scored, length) in enumerate(zip(reply.sequences, lengths, strict=True)):
        if len(scored.logprobs) != length:
            return f"sequence {i}: {len(scored.logprobs)} logprobs for {length} completion tokens"
        if not all(math.isfinite(x) and x <= 1e-3 for x in scored.logprobs):
            return f"sequence {i}: a logprob that is not a finite log-probability"
        tops = (len(scored.top_token_ids), len(scored.top_logprobs))
        if tops != (length * top_k,) * 2:
            return f"sequence {i}: {tops[0]} top ids and {tops[1]} top logprobs for {length} tokens × k {top_k}"
        if (
            not all(math.isfinite(x) and x <= 1e-3 for x in scored.top_logprobs)
            or min(scored.top_token_ids, default=0) < 0
        ):
            return f"sequence {i}: a top-k entry that is not a token and its finite log-probability"
    return ""


class TeacherScoring:
    def __init__(self, client: PoolClient, top_k: int = 0) -> None:
        self.client = client
        self.top_k = top_k

    async def attach(self, payloads: list[bytes]) -> list[bytes]:
        """The same rollouts with the teacher's logprob of every completion token (and its top-k at
        each position); raises PoolError."""
        request, rollouts = score_request(payloads, self.top_k)
        lengths = [len(r.completion_token_ids) for r in rollouts]
        reply = await self.client.call("Score", request, check=lambda r: reply_problem(r, lengths, self.top_k))
        for rollout, scored in zip(rollouts, reply.sequences, strict=True):
            rollout.teacher_logprobs = np.asarray(scored.logprobs, dtype=np.float32)
            if self.top_k:
                rollout.teacher_top_ids = np.asarray(scored.top_token_ids, dtype=np.int32).reshape(-1, self.top_k)
                rollout.teacher_top_logprobs = np.asarray(scored.top_logprobs, dtype=np.float32).reshape(-1, self.top_k)
        return [encode_rollout(r) for r in rollouts]
