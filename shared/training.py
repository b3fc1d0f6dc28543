"""From rollouts to the tensors of a training step, and the training engine's logprobs.

Layout: each rollout is one row of the full sequence s = prompt + completion, right-padded to
S = max(P + C). Per-token tensors are [B, S − 1] in the "next token" layout: position j holds
what the logits at j say about token j + 1, so completion token t of a row sits at P + t − 1.
A routing trace covers positions 0 .. P + C − 2 of the forward (every input token but the last),
so it is replayed on [B, S] with a mask that frees the last token and the padding.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch

from shared.core.advantages import group_advantages
from shared.core.diagnostics import entropy_from_logits, routing_agreement
from shared.core.loss import LossConfig, policy_loss
from shared.models.routing import RoutingController
from shared.rollout import Rollout


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

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    def select(self, rows: list[int] | torch.Tensor) -> TrainBatch:
        index = torch.as_tensor(rows, dtype=torch.long)
        pick = (lambda t: None if t is None else t.index_select(0, index))  # noqa: E731
        return TrainBatch(
            pick(self.input_ids), pick(self.attention_mask), pick(self.loss_mask), pick(self.inference_logprobs),
            pick(self.versions), pick(self.rewards), pick(self.trace), pick(self.trace_mask),
            [self.rollout_ids[i] for i in index.tolist()],
        )


def collate(rollouts: list[Rollout], pad_token_id: int = 0) -> TrainBatch:
    if not rollouts:
        raise ValueError("no rollouts to collate")
    lengths = [len(r.prompt_token_ids) + len(r.completion_token_ids) for r in rollouts]
    batch, width = len(rollouts), max(lengths)
    input_ids = torch.full((batch, width), pad_token_id, dtype=torch.long)
    attention = torch.zeros(batch, width, dtype=torch.long)
    loss_mask = torch.zeros(batch, width - 1, dtype=torch.bool)
    inference = torch.zeros(batch, width - 1)
    versions = torch.zeros(batch, width - 1, dtype=torch.long)
    with_trace = all(r.routing_trace is not None for r in rollouts)
    trace = trace_mask = None
    if with_trace:
        layers, top_k = rollouts[0].routing_trace.shape[1:]
        trace = torch.zeros(batch, width, layers, top_k, dtype=torch.long)
        trace_mask = torch.zeros(batch, width, dtype=torch.bool)
    for row, r in enumerate(rollouts):
        prompt, completion = len(r.prompt_token_ids), len(r.completion_token_ids)
        tokens = np.concatenate([r.prompt_token_ids, r.completion_token_ids]).astype(np.int64)
        input_ids[row, : len(tokens)] = torch.from_numpy(tokens)
        attention[row, : len(tokens)] = 1
        span = slice(prompt - 1, prompt + completion - 1)
        loss_mask[row, span] = True
        inference[row, span] = torch.from_numpy(np.asarray(r.inference_logprobs, dtype=np.float32))
        versions[row, span] = torch.from_numpy(np.asarray(r.policy_versions, dtype=np.int64))
        if with_trace:
            positions = r.routing_trace.shape[0]
            trace[row, :positions] = torch.from_numpy(r.routing_trace.astype(np.int64))
            trace_mask[row, :positions] = True
    rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float32)
    return TrainBatch(input_ids, attention, loss_mask, inference, versions, rewards, trace, trace_mask,
                      [r.rollout_id for r in rollouts])


@dataclass
class Forward:
    logprobs: torch.Tensor  # [B, S-1] log π(y_{j+1}) at each position (with grad when asked)
    entropy: torch.Tensor  # scalar: mean token entropy over the loss mask (no grad)
    routing: torch.Tensor | None  # [B, S, layers, top_k] experts the forward routed to (captured)


def sequence_logprobs(model, batch: TrainBatch, routing: RoutingController | None = None,
                      replay: torch.Tensor | None = None, replay_mask: torch.Tensor | None = None,
                      capture: bool = False) -> Forward:
    """One forward of the training engine over `batch`: next-token logprobs and entropy.

    `replay` ([B, S, L, K] with `replay_mask` [B, S]) forces the routing; `capture` records it.
    """
    if (replay is not None or capture) and routing is None:
        raise ValueError("routing replay or capture needs a RoutingController")
    context: contextlib.AbstractContextManager = contextlib.nullcontext()
    if replay is not None:
        context = routing.replay(replay, replay_mask)
    elif capture:
        context = routing.capture()
    with context as recording:
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logits = logits[:, :-1].float()
    targets = batch.input_ids[:, 1:]
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = entropy_from_logits(logits.detach(), batch.loss_mask)
    captured = recording.trace(batch.input_ids.shape) if capture else None
    return Forward(logprobs, entropy, captured)


REPLAY_MODES = ("off", "r2", "r3")


@dataclass(frozen=True)
class StepConfig:
    """One global step: how advantages, π_old, mini-batches and routing replay are formed."""

    loss: LossConfig = LossConfig()
    advantage: str = "mean"
    """Group baseline: "mean" (MiniRL), "std" (GRPO), "loo"."""
    mini_batches: int = 1
    """N: optimizer steps per global step (1 = on-policy)."""
    replay: str = "off"
    """Routing replay: "off", "r2" (π_old recompute's experts), "r3" (inference traces)."""
    bypass: bool = False
    """π_old := μ_old (no recompute forward)."""
    grad_clip: float = 1.0
    """Max global grad norm (0 = off)."""

    def __post_init__(self) -> None:
        if self.replay not in REPLAY_MODES:
            raise ValueError(f"replay must be one of {REPLAY_MODES}, got {self.replay!r}")
        if self.mini_batches < 1:
            raise ValueError("mini_batches must be >= 1")
        if self.replay == "r2" and self.bypass:
            raise ValueError("R2 replays the π_old recompute's routing: it needs bypass off")


def resolve_recipe(mini_batches: int, staleness_max: int, has_traces: bool) -> tuple[str, bool, str]:
    """The paper's recipe (DESIGN.md §3) → (replay, clip, why)."""
    if mini_batches >= 4 or staleness_max >= 2:
        if has_traces:
            return "r3", True, f"strongly off-policy (N={mini_batches}, staleness {staleness_max}): clip + R3"
        return "r2", True, f"strongly off-policy (N={mini_batches}, staleness {staleness_max}) but no traces: clip + R2"
    if mini_batches >= 2 or staleness_max >= 1:
        return "r2", True, f"mildly off-policy (N={mini_batches}, staleness {staleness_max}): clip + R2"
    return "off", True, "on-policy (N=1, staleness 0): MiniRL + TIS, no replay"


def split_groups(num_groups: int, group_size: int, parts: int) -> list[list[int]]:
    """Rows of `parts` mini-batches, each a contiguous run of whole groups."""
    if parts > num_groups:
        raise ValueError(f"{parts} mini-batches need at least {parts} groups, got {num_groups}")
    bounds = [round(i * num_groups / parts) for i in range(parts + 1)]
    return [list(range(bounds[i] * group_size, bounds[i + 1] * group_size)) for i in range(parts)]


def _global_sum(value: torch.Tensor, world: int) -> torch.Tensor:
    if world > 1:
        import torch.distributed as dist

        value = value.clone()
        dist.all_reduce(value)
    return value


def train_step(model, optimizer, routing: RoutingController | None, batch: TrainBatch, group_size: int,
               config: StepConfig, version: int, rank: int = 0, world: int = 1) -> dict[str, float]:
    """One global step on `batch` (rows grouped G by G): advantages, π_old, N optimizer steps.

    Data parallel (`world` > 1, `model` wrapped in DistributedDataParallel): every rank holds the
    whole global batch, computes the advantages of all of it, and works on rows[rank::world] of
    each mini-batch; the loss normalisers are summed over ranks and the loss is scaled by `world`
    (DDP averages gradients), so the update equals one process on the whole batch.
    Returns the step's diagnostics (this rank's means over the mini-batches)."""
    import time

    if batch.size % group_size:
        raise ValueError(f"{batch.size} rows are not whole groups of {group_size}")
    is_moe = routing is not None and routing.is_moe
    if config.replay == "r3" and batch.trace is None:
        raise ValueError("R3 needs a routing trace on every rollout")
    if config.replay != "off" and not is_moe:
        raise ValueError(f"routing replay {config.replay} needs an MoE model")
    advantages = group_advantages(batch.rewards.view(-1, group_size), config.advantage).reshape(-1)
    staleness = (version - batch.versions).clamp(min=0).float()
    rows_of = [rows[rank::world] for rows in split_groups(batch.size // group_size, group_size, config.mini_batches)]
    if any(not rows for rows in rows_of):
        raise ValueError(f"a mini-batch has fewer rows than the {world} ranks")
    mine = [row for rows in rows_of for row in rows]
    position = {row: i for i, row in enumerate(mine)}
    local = batch.select(mine)
    inner = getattr(model, "module", model)
    old = r2_trace = agreement = None
    with torch.no_grad():
        if not config.bypass:
            recompute = sequence_logprobs(
                model, local, routing,
                replay=local.trace if config.replay == "r3" else None,
                replay_mask=local.trace_mask if config.replay == "r3" else None,
                capture=is_moe and config.replay != "r3",
            )
            old = recompute.logprobs
            r2_trace = recompute.routing
        if is_moe and local.trace is not None:
            own = r2_trace if r2_trace is not None else sequence_logprobs(inner, local, routing, capture=True).routing
            agreement = float(routing_agreement(own, local.trace, local.trace_mask))
    totals: dict[str, float] = {}
    loss_seconds = 0.0
    entropies, grad_norms = [], []
    for rows in rows_of:
        mb = batch.select(rows)
        at = torch.tensor([position[row] for row in rows])
        replay = replay_mask = None
        if config.replay == "r3":
            replay, replay_mask = mb.trace, mb.trace_mask
        elif config.replay == "r2":
            replay, replay_mask = r2_trace.index_select(0, at), mb.attention_mask.bool()
        optimizer.zero_grad(set_to_none=True)
        forward = sequence_logprobs(model, mb, routing, replay=replay, replay_mask=replay_mask)
        started = time.perf_counter()
        counted = mb.loss_mask & torch.isfinite(mb.inference_logprobs)  # policy_loss drops the others
        tokens = _global_sum(counted.sum(), world)
        sequences = _global_sum(counted.any(dim=-1).sum(), world)
        loss, metrics = policy_loss(
            forward.logprobs, None if old is None else old.index_select(0, at), mb.inference_logprobs,
            advantages.index_select(0, torch.tensor(rows)), mb.loss_mask, config.loss,
            token_normalizer=tokens, sequence_normalizer=sequences,
        )
        loss_seconds += time.perf_counter() - started
        (loss * world).backward()
        max_norm = config.grad_clip if config.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        grad_norms.append(float(grad_norm))
        entropies.append(float(forward.entropy))
        for key, value in metrics.items():
            totals[key] = totals.get(key, 0.0) + float(value) / len(rows_of)
        totals["loss"] = totals.get("loss", 0.0) + float(loss.detach()) / len(rows_of)
    mask = batch.loss_mask
    totals.update(
        reward_mean=float(batch.rewards.mean()),
        entropy=sum(entropies) / len(entropies),
        grad_norm=sum(grad_norms) / len(grad_norms),
        staleness_mean=float(staleness[mask].mean()) if mask.any() else 0.0,
        staleness_max=float(staleness[mask].max()) if mask.any() else 0.0,
        loss_seconds=loss_seconds,
        tokens=float(mask.sum()),
    )
    if agreement is not None:
        totals["routing_agreement"] = agreement
    return totals
