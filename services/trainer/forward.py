"""The training engine's forward: next-token logprobs and entropy of a batch, in the precision
and on the device the step runs with, the loss math always in fp32.

`Compute` says how a step is computed — never what it computes: the device, bf16 autocast over
fp32 parameters (`bf16-mixed`: parameters, gradients and optimizer state stay fp32; under FSDP
the same is a MixedPrecisionPolicy set where the model is sharded), and micro-batches of at most
`compute.micro_batch_tokens` tokens whose gradients accumulate into one update; exact mode's
batch-invariant forwards (`shared.models.batch_invariant`, the replicas' own).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from services.trainer.batch import TrainBatch
from services.trainer.shared_prefix import plan_prefix, prefix_logits, prefix_trace, shareable
from shared.core.diagnostics import entropy_from_logits
from shared.models.batch_invariant import BatchInvariant
from shared.models.routing import RoutingController


@dataclass(frozen=True)
class Compute:
    device: torch.device = torch.device("cpu")
    """Where the model and each micro-batch live."""
    autocast: torch.dtype | None = None
    """bf16-mixed: forwards under torch.autocast to this dtype (None: the parameters' dtype)."""
    micro_batch_tokens: int = 0
    """Tokens per micro-batch (gradient accumulation within a mini-batch); 0 = the whole mini-batch."""
    exact: bool = False
    """Batch-invariant forwards: a row's logprobs are those an exact-mode replica sampled with, bit for bit."""
    shared_prefix: bool = False
    """Each distinct prompt prefix of a batch computed once (services.trainer.shared_prefix), where
    the model is unwrapped, the routing free or captured and the forwards not exact."""


@dataclass
class Forward:
    logprobs: torch.Tensor  # [B, S-1] float32: log π(y_{j+1}) at each position (with grad when asked)
    entropy_per_token: torch.Tensor  # [B, S-1] float32 token entropy of π (with grad for the entropy bonus)
    routing: torch.Tensor | None  # [B, S, layers, top_k] experts the forward routed to (captured)
    top_logprobs: torch.Tensor | None = None  # [B, S-1, k] log π at the teacher's top-k ids (when asked)


def routing_context(
    routing: RoutingController | None,
    replay: torch.Tensor | None = None,
    replay_mask: torch.Tensor | None = None,
    capture: bool = False,
):
    """The routing mode of the forwards (and, with activation checkpointing, of the recomputes in
    the backward) inside the block: replay `replay`, capture, or free."""
    if (replay is not None or capture) and routing is None:
        raise ValueError("routing replay or capture needs a RoutingController")
    if replay is not None:
        return routing.replay(replay, replay_mask)
    if capture:
        return routing.capture()
    return contextlib.nullcontext()


def sequence_logprobs(
    model,
    batch: TrainBatch,
    routing: RoutingController | None = None,
    replay: torch.Tensor | None = None,
    replay_mask: torch.Tensor | None = None,
    capture: bool = False,
    compute: Compute = Compute(),
    entropy_grad: bool = False,
    teacher_top: bool = False,
    share_prefix: bool = True,
) -> Forward:  # noqa: B008
    """One forward of the training engine over `batch`: next-token logprobs and entropy, in fp32
    whatever the parameters' or the autocast dtype. `replay` ([B, S, L, K] with `replay_mask`
    [B, S]) forces the routing; `capture` records it; `entropy_grad`: the entropy keeps its graph
    (an entropy bonus in the loss); `teacher_top`: log π at the batch's teacher top-k ids too;
    `share_prefix`: the caller routes no replay around this call, so `compute.shared_prefix` may apply."""
    autocast = torch.autocast(
        compute.device.type, dtype=compute.autocast or torch.float32, enabled=compute.autocast is not None
    )
    with BatchInvariant() if compute.exact else contextlib.nullcontext():
        prefix = None
        if compute.shared_prefix and share_prefix and replay is None and not compute.exact and shareable(model):
            prefix = plan_prefix(batch.input_ids, batch.attention_mask, batch.loss_mask)
        with routing_context(routing, replay, replay_mask, capture) as recording, autocast:
            if prefix is None:
                logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
            else:
                logits, shared = prefix_logits(model, batch.input_ids, batch.attention_mask, prefix)
                prefix = prefix if shared else None  # the whole rows ran after all: the last call's trace
        logits = logits[:, :-1].float()  # the loss math in fp32, outside autocast
        log_softmax = torch.log_softmax(logits, dim=-1)
    targets = batch.input_ids[:, 1:]
    logprobs = log_softmax.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if entropy_grad:
        entropy = -(log_softmax.exp() * log_softmax).sum(dim=-1)
    else:
        with torch.no_grad():
            entropy = entropy_from_logits(logits.detach())
    captured = None
    if capture:
        rows, width = batch.input_ids.shape
        captured = recording.trace((rows, width)) if prefix is None else prefix_trace(recording, rows, width, prefix)
    top = log_softmax.gather(-1, batch.teacher_top_ids) if teacher_top else None
    return Forward(logprobs, entropy, captured, top)


@contextlib.contextmanager
def gradient_sync(model, enabled: bool) -> Iterator[None]:
    """Accumulate gradients locally (no all-reduce / reduce-scatter) unless `enabled`: every
    micro-batch but a mini-batch's last. DDP: `no_sync`; FSDP2: `set_requires_gradient_sync`."""
    if enabled:
        yield
    elif hasattr(model, "no_sync"):
        with model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield
