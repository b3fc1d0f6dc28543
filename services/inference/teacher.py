"""A rollout replica's side of on-policy distillation: each finished group is sent to the teacher
pool, which scores every completion token given the same context (a prefill), and the teacher's
logprobs (with `top_k`, its k most likely tokens at each position too) ride on the rollouts to the
trainer. A pool that is down, slow or answers garbage fails the
call after its bounded attempts (`PoolError`): the worker hands the task back, and the queue retries
it and, past its attempts, dead-letters it with the reason.

Details: docs/guides/pools.md"""

from __future__ import annotations

import asyncio
from collections import deque

import numpy as np

from shared.rollouts.record import MIN_LOGPROB, decode_rollout, encode_rollout, logprobs_valid, top_k_problem
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


def reply_problem(reply: pb.ScoreReply, lengths: list[int], top_k: int = 0, vocab_size: int | None = None) -> str:
    """Why a teacher's reply cannot be used ('' when it can), `code: detail`: one logprob per
    completion token of every sequence, each, as the float32 the loss holds, finite and within
    [MIN_LOGPROB, 0]; with `top_k`, k distinct ids in the vocabulary and k such logprobs per
    completion token. Teacher replicas are not trusted: a bad reply costs one attempt."""
    if len(reply.sequences) != len(lengths):
        return f"sequence_count: {len(reply.sequences)} sequences scored, {len(lengths)} sent"
    for i, (scored, length) in enumerate(zip(reply.sequences, lengths, strict=True)):
        if len(scored.logprobs) != length:
            return f"logprob_count: sequence {i}: {len(scored.logprobs)} logprobs for {length} completion tokens"
        if not logprobs_valid(np.fromiter(scored.logprobs, np.float64, length)):
            return f"logprob_range: sequence {i}: a logprob that is not finite or not within [{MIN_LOGPROB:g}, 0]"
        tops = (len(scored.top_token_ids), len(scored.top_logprobs))
        if tops != (length * top_k,) * 2:
            return f"top_k_count: sequence {i}: {tops[0]} ids, {tops[1]} logprobs for {length} tokens × k {top_k}"
        if not top_k:
            continue
        ids = np.fromiter(scored.top_token_ids, np.int64, tops[0]).reshape(length, top_k)
        logprobs = np.fromiter(scored.top_logprobs, np.float64, tops[1]).reshape(length, top_k)
        problem = top_k_problem(ids, logprobs, vocab_size)  # what the trainer would refuse, asked here
        if problem:
            code, detail = problem.split(": ", 1)
            return f"{code}: sequence {i}: {detail}"
    return ""


class TeacherScoring:
    """The rollout replica's scoring client. Groups that finish while a Score call is out wait and
    go together in the next one (at most `batch_sequences` sequences a call, two calls or one per
    address out at once): a step's groups cost a few calls, not one each, and none waits on a timer.
    A failed call fails every group in it; each is handed back on its own."""

    def __init__(
        self, client: PoolClient, top_k: int = 0, batch_sequences: int = 256, vocab_size: int | None = None
    ) -> None:
        self.client = client
        self.top_k = top_k
        self.vocab_size = vocab_size  # the policy's: a top-k id past it names no token the trainer can score
        self.batch_sequences = batch_sequences
        self.slots = max(2, len(client.addresses))
        self.calls = 0  # Score calls sent (each carries one or more groups)
        self._waiting: deque[tuple[list[bytes], asyncio.Future]] = deque()
        self._out: set[asyncio.Task] = set()

    async def attach(self, payloads: list[bytes]) -> list[bytes]:
        """The same rollouts with the teacher's logprob of every completion token (and its top-k at
        each position); raises PoolError."""
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((payloads, future))
        self._send_waiting()
        return await future

    def _send_waiting(self) -> None:
        while self._waiting and len(self._out) < self.slots:
            batch, size = [], 0
            while self._waiting and (not batch or size + len(self._waiting[0][0]) <= self.batch_sequences):
                payloads, future = self._waiting.popleft()
                if not future.done():  # its task was cancelled meanwhile: nothing to score
                    batch.append((payloads, future))
                    size += len(payloads)
            if batch:
                task = asyncio.create_task(self._call(batch))
                self._out.add(task)
                task.add_done_callback(self._call_done)

    def _call_done(self, task: asyncio.Task) -> None:
        self._out.discard(task)
        self._send_waiting()

    async def _call(self, batch: list[tuple[list[bytes], asyncio.Future]]) -> None:
        try:
            scored = await self._score([p for payloads, _ in batch for p in payloads])
        except asyncio.CancelledError:  # the replica stops: so do the groups waiting on this call
            for _, future in batch:
                future.cancel()
            raise
        except Exception as exc:  # noqa: BLE001 - a PoolError or anything else: no group waits forever
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        start = 0
        for payloads, future in batch:
            if not future.done():
                future.set_result(scored[start : start + len(payloads)])
            start += len(payloads)

    async def _score(self, payloads: list[bytes]) -> list[bytes]:
        request, rollouts = score_request(payloads, self.top_k)
        lengths = [len(r.completion_token_ids) for r in rollouts]
        self.calls += 1
        reply = await self.client.call(
            "Score", request, check=lambda r: reply_problem(r, lengths, self.top_k, self.vocab_size)
        )
        for rollout, scored in zip(rollouts, reply.sequences, strict=True):
            rollout.teacher_logprobs = np.asarray(scored.logprobs, dtype=np.float32)
            if self.top_k:
                rollout.teacher_top_ids = np.asarray(scored.top_token_ids, dtype=np.int32).reshape(-1, self.top_k)
                rollout.teacher_top_logprobs = np.asarray(scored.top_logprobs, dtype=np.float32).reshape(-1, self.top_k)
        return [encode_rollout(r) for r in rollouts]
