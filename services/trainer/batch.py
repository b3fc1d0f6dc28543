"""From rollouts to the tensors of a training step.

Layout: each rollout is one row of the full sequence s = prompt + completion, right-padded to
S = max(P + C). Per-token tensors are [B, S − 1] in the "next token" layout: position j holds
what the logits at j say about token j + 1, so completion token t of a row sits at P + t − 1.
A routing trace covers positions 0 .. P + C − 2 of the forward (every input token but the last),
so it is replayed on [B, S] with a mask that frees the last token and the padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from shared.rollouts.record import Rollout


@dataclass
class TrainBatch:
    input_ids: torch.Tensor  # [B, S] long
    attention_mask: torch.Tensor  # [B, S] long
    loss_mask: torch.Tensor  # [B, S-1] bool: completion tokens
    inference_logprobs: torch.Tensor  # [B, S-1] float32 (0 off the mask)
    versions: torch.Tensor  # [B, S-1] long (0 off the mask)
    rewards: torch.Tensor  # [B] float32
    trace: torch.Tensor | None  # [B, S, layers, top_k] long, when every rollout has one
    trace_mask: torch.Tensor | None  # [B, S] bool: positions the trace covers
    rollout_ids: list[str]
    teacher_logprobs: torch.Tensor | None = (
        None  # [B, S-1] float32, when every rollout has a teacher's (0 off the mask)
    )
    teacher_top_ids: torch.Tensor | None = None  # [B, S-1, k] long: the teacher's top-k (0 off the mask)
    teacher_top_logprobs: torch.Tensor | None = None  # [B, S-1, k] float32: their logprobs (0 off the mask)
    scored: torch.Tensor | None = None  # [B] bool: whose reward scored (None: all); the others are off the loss

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def width(self) -> int:
        """S: positions per row."""
        return self.input_ids.shape[1]

    def lengths(self) -> torch.Tensor:
        """[B] tokens of each row (prompt + completion)."""
        return self.attention_mask.sum(dim=1)

    def select(self, rows: list[int] | torch.Tensor) -> TrainBatch:
        index = torch.as_tensor(rows, dtype=torch.long)
        pick = lambda t: None if t is None else t.index_select(0, index.to(t.device))  # noqa: E731
        return TrainBatch(
            pick(self.input_ids),
            pick(self.attention_mask),
            pick(self.loss_mask),
            pick(self.inference_logprobs),
            pick(self.versions),
            pick(self.rewards),
            pick(self.trace),
            pick(self.trace_mask),
            [self.rollout_ids[i] for i in index.tolist()],
            pick(self.teacher_logprobs),
            pick(self.teacher_top_ids),
            pick(self.teacher_top_logprobs),
            pick(self.scored),
        )

    def trimmed(self) -> TrainBatch:
        """The same rows cut to their own longest row (less padding to compute)."""
        width = max(int(self.lengths().max()), 2)
        cut = lambda t, n: None if t is None else t[:, :n]  # noqa: E731
        return TrainBatch(
            cut(self.input_ids, width),
            cut(self.attention_mask, width),
            cut(self.loss_mask, width - 1),
            cut(self.inference_logprobs, width - 1),
            cut(self.versions, width - 1),
            self.rewards,
            cut(self.trace, width),
            cut(self.trace_mask, width),
            self.rollout_ids,
            cut(self.teacher_logprobs, width - 1),
            cut(self.teacher_top_ids, width - 1),
            cut(self.teacher_top_logprobs, width - 1),
            self.scored,
        )

    def to(self, device: torch.device) -> TrainBatch:
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return TrainBatch(
            move(self.input_ids),
            move(self.attention_mask),
            move(self.loss_mask),
            move(self.inference_logprobs),
            move(self.versions),
            move(self.rewards),
            move(self.trace),
            move(self.trace_mask),
            self.rollout_ids,
            move(self.teacher_logprobs),
            move(self.teacher_top_ids),
            move(self.teacher_top_logprobs),
            move(self.scored),
        )


def collate(rollouts: list[Rollout], pad_token_id: int = 0, mask_truncated: bool = False) -> TrainBatch:
    """The rollouts as one left-aligned batch; `mask_truncated`: a rollout that ran out of tokens
    (finish reason "length") keeps no token in the loss mask. A rollout whose reward failed
    (`reward_error`) keeps none either: it is left out of the loss and of its group's baseline."""
    if not rollouts:
        raise ValueError("no rollouts to collate")
    lengths = [len(r.prompt_token_ids) + len(r.completion_token_ids) for r in rollouts]
    batch = len(rollouts)
    width = max(lengths)
    # filled row by row in numpy (a slice assignment there costs a tenth of torch's), handed over once
    input_ids = np.full((batch, width), pad_token_id, dtype=np.int64)
    attention = np.zeros((batch, width), dtype=np.int64)
    loss_mask = np.zeros((batch, width - 1), dtype=bool)
    inference = np.zeros((batch, width - 1), dtype=np.float32)
    versions = np.zeros((batch, width - 1), dtype=np.int64)
    with_trace = all(r.routing_trace is not None for r in rollouts)
    teacher = (
        np.zeros((batch, width - 1), dtype=np.float32)
        if all(r.teacher_logprobs is not None for r in rollouts)
        else None
    )
    top_ids = top_logprobs = None
    top_k = {None if r.teacher_top_ids is None else r.teacher_top_ids.shape[1] for r in rollouts}
    if len(top_k) == 1 and None not in top_k:  # every rollout with the teacher's top-k, one k
        top_ids = np.zeros((batch, width - 1, top_k.pop()), dtype=np.int64)
        top_logprobs = np.zeros(top_ids.shape, dtype=np.float32)
    trace = trace_mask = None
    if with_trace:
        layers, top_k = rollouts[0].routing_trace.shape[1:]
        trace = np.zeros((batch, width, layers, top_k), dtype=np.int64)
        trace_mask = np.zeros((batch, width), dtype=bool)
    for row, r in enumerate(rollouts):
        prompt = len(r.prompt_token_ids)
        completion = len(r.completion_token_ids)
        input_ids[row, :prompt] = r.prompt_token_ids
        input_ids[row, prompt : prompt + completion] = r.completion_token_ids
        attention[row, : prompt + completion] = 1
        span = slice(prompt - 1, prompt + completion - 1)
        if not (mask_truncated and r.finish_reason == "length") and not r.reward_error:
            loss_mask[row, span] = r.model_tokens  # a multi-turn trajectory: the model's tokens
        inference[row, span] = r.inference_logprobs
        versions[row, span] = r.policy_versions
        if teacher is not None:
            teacher[row, span] = r.teacher_logprobs
        if top_ids is not None:
            top_ids[row, span] = r.teacher_top_ids
            top_logprobs[row, span] = r.teacher_top_logprobs
        if with_trace:
            positions = r.routing_trace.shape[0]
            trace[row, :positions] = r.routing_trace
            trace_mask[row, :positions] = True
    rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float32)
    return TrainBatch(
        torch.from_numpy(input_ids),
        torch.from_numpy(attention),
        torch.from_numpy(loss_mask),
        torch.from_numpy(inference),
        torch.from_numpy(versions),
        rewards,
        None if trace is None else torch.from_numpy(trace),
        None if trace_mask is None else torch.from_numpy(trace_mask),
        [r.rollout_id for r in rollouts],
        None if teacher is None else torch.from_numpy(teacher),
        None if top_ids is None else torch.from_numpy(top_ids),
        None if top_logprobs is None else torch.from_numpy(top_logprobs),
        torch.tensor([not r.reward_error for r in rollouts], dtype=torch.bool),
    )


def split_groups(num_groups: int, group_size: int, parts: int) -> list[list[int]]:
    """Rows of `parts` mini-batches, each a contiguous run of whole groups."""
    if parts > num_groups:
        raise ValueError(f"{parts} mini-batches need at least {parts} groups, got {num_groups}")
    bounds = [round(i * num_groups / parts) for i in range(parts + 1)]
    return [list(range(bounds[i] * group_size, bounds[i + 1] * group_size)) for i in range(parts)]


def token_budget_chunks(lengths: list[int], budget: int) -> list[list[int]]:
    """Consecutive positions of `lengths` in chunks of at most `budget` tokens each (a row longer
    than the budget is a chunk of its own); budget 0 = one chunk."""
    if budget <= 0 or not lengths:
        return [list(range(len(lengths)))]
    chunks: list[list[int]] = [[]]
    used = 0
    for i, n in enumerate(lengths):
        if chunks[-1] and used + n > budget:
            chunks.append([])
            used = 0
        chunks[-1].append(i)
        used += n
    return chunks
