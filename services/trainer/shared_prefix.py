"""A batch's shared prompt prefix computed once: the G samples of a group begin with the same
prompt, so the training forward runs each distinct prefix once, keeps its keys and values, and
runs every row's remainder against them. Causal attention makes this the same computation as the
whole rows' (the rows' gradients sum into the shared prefix through autograd); only the order of
fp32 sums changes. Details: docs/internals/trainer.md#servicestrainershared_prefixpy."""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_SHARE = 0.8
"""Shared only where the positions computed fall to at most this share of the batch's."""


@dataclass(frozen=True)
class PrefixPlan:
    length: int
    """L: every row's first L tokens are real tokens and its own group's prefix."""
    unique: torch.Tensor
    """[U, L] the distinct prefixes."""
    inverse: torch.Tensor
    """[B] each row's prefix in `unique`."""


def plan_prefix(input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor) -> PrefixPlan | None:
    """The longest prefix every row holds before its first trained token (and before any padding),
    with the distinct ones; None where sharing would not save at least 1 − MAX_SHARE of the positions."""
    rows, width = input_ids.shape
    if rows < 2 or width < 3:
        return None
    trained = loss_mask.bool()
    # loss position j trains token j + 1: tokens 0..j are the prompt; a row with none trained caps nothing
    prompt = torch.where(trained.any(1), trained.int().argmax(1) + 1, torch.full((rows,), width - 1))
    real = attention_mask.long().cumprod(1).sum(1)  # real tokens before the first padding
    length = min(int(torch.minimum(prompt, real).min()), width - 1)
    if length < 1:
        return None
    unique, inverse = torch.unique(input_ids[:, :length], dim=0, return_inverse=True)
    if unique.shape[0] * length + rows * (width - length) > MAX_SHARE * rows * width:
        return None
    return PrefixPlan(length, unique, inverse)


UNSHARED: set[type] = set()
"""Model classes whose cache is no DynamicCache (a hybrid or static one): whole rows from then on."""


def prefix_logits(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor, plan: PrefixPlan
) -> tuple[torch.Tensor, bool]:
    """The logits [B, S, V] of `model(input_ids, attention_mask)`, each distinct prefix run once:
    its keys and values are gathered to its rows and the rows' remainders attend to them. False
    beside them where the model's cache could not be gathered and the whole rows were run instead."""
    from transformers import DynamicCache

    head = model(input_ids=plan.unique, attention_mask=torch.ones_like(plan.unique), use_cache=True)
    cache = head.past_key_values
    if not isinstance(cache, DynamicCache):
        UNSHARED.add(type(model))
        return model(input_ids=input_ids, attention_mask=attention_mask).logits, False
    cache.batch_select_indices(plan.inverse)  # indexing keeps the graph: each row's gradient reaches its prefix
    tail = model(
        input_ids=input_ids[:, plan.length :],
        attention_mask=attention_mask,
        past_key_values=cache,
        use_cache=True,
    )
    return torch.cat([head.logits.index_select(0, plan.inverse), tail.logits], dim=1), True


def prefix_trace(recording, rows: int, width: int, plan: PrefixPlan) -> torch.Tensor:
    """The routing trace [B, S, layers, top_k] of a prefix-shared forward's two calls."""
    head = recording.trace((plan.unique.shape[0], plan.length), call=-2)
    tail = recording.trace((rows, width - plan.length), call=-1)
    return torch.cat([head.index_select(0, plan.inverse), tail], dim=1)


def shareable(model) -> bool:
    """A plain module the prefix's cache can pass through: not wrapped for data parallelism (DDP
    expects one forward per backward, FSDP gathers per forward) and not recomputing activations
    (transformers turns the cache off under gradient checkpointing), and not of a class whose cache
    could not be gathered."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return False
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule) or type(model) in UNSHARED:  # prepare() shards the root too
        return False
    return not getattr(model, "is_gradient_checkpointing", False)
