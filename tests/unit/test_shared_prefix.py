"""A group's prompt computed once in the training forward (services.trainer.shared_prefix): the same
logits, gradients, routing and step as whole rows, to fp32 rounding, and whole rows wherever the
cache cannot pass (replay, exact, activation checkpointing) or nothing is saved."""

from __future__ import annotations

import copy

import pytest
import torch

from services.trainer.batch import TrainBatch
from services.trainer.forward import Compute, sequence_logprobs
from services.trainer.global_step import StepConfig, train_step
from services.trainer.shared_prefix import plan_prefix
from shared.models import load_causal_lm
from shared.models.routing import RoutingController

GROUP = 4
PROMPTS = [[1, 4, 10, 14, 7, 11], [1, 5, 9, 17], [1, 4, 10, 14, 7, 11, 17], [1, 6, 12, 8, 13]]


def grouped_batch(seed: int = 0, prompts=PROMPTS) -> TrainBatch:
    """Groups of GROUP rows, each group one prompt (4 to 7 tokens), each row its own completion
    of 1 to 5 tokens, right-padded: the shape of a step's batch."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for prompt in prompts:
        for _ in range(GROUP):
            n = int(torch.randint(1, 6, (1,), generator=g))
            rows.append((prompt, torch.randint(3, 30, (n,), generator=g).tolist()))
    width = max(len(p) + len(c) for p, c in rows)
    size = len(rows)
    input_ids = torch.zeros(size, width, dtype=torch.long)
    attention = torch.zeros(size, width, dtype=torch.long)
    loss_mask = torch.zeros(size, width - 1, dtype=torch.bool)
    for i, (prompt, completion) in enumerate(rows):
        tokens = prompt + completion
        input_ids[i, : len(tokens)] = torch.tensor(tokens)
        attention[i, : len(tokens)] = 1
        loss_mask[i, len(prompt) - 1 : len(tokens) - 1] = True
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention,
        loss_mask=loss_mask,
        inference_logprobs=torch.where(loss_mask, -1.0, 0.0),
        versions=torch.zeros(size, width - 1, dtype=torch.long),
        rewards=torch.tensor([float(i % 2) for i in range(size)]),
        trace=None,
        trace_mask=None,
        rollout_ids=[f"r{i}" for i in range(size)],
    )


def counting(model) -> list[int]:
    """The number of tokens of each top-level forward of `model`, appended as it runs."""
    calls: list[int] = []
    model.register_forward_pre_hook(lambda m, a, k: calls.append(int(k["input_ids"].numel())), with_kwargs=True)
    return calls


def test_the_plan_is_the_shortest_prompt_and_each_distinct_prefix():
    batch = grouped_batch()
    plan = plan_prefix(batch.input_ids, batch.attention_mask, batch.loss_mask)
    assert plan is not None and plan.length == 4  # the shortest prompt, [1, 5, 9, 17]
    assert plan.unique.shape == (3, 4)  # two prompts share their first four tokens
    assert torch.equal(plan.unique[plan.inverse], batch.input_ids[:, :4])
    # a row trained from its first token, or padded before its prompt ends, shortens the prefix
    early = batch.loss_mask.clone()
    early[5, 0] = True
    assert plan_prefix(batch.input_ids, batch.attention_mask, early) is None  # L = 1 saves too little
    # every row its own prompt: nothing shared, nothing saved
    distinct = grouped_batch(prompts=[[1, 4, 10, 14, 7, 11]])
    distinct.input_ids[:, 1] = torch.arange(GROUP) + 3
    assert plan_prefix(distinct.input_ids, distinct.attention_mask, distinct.loss_mask) is None


def test_logits_gradients_and_routing_equal_whole_rows(tiny_model_dir):
    torch.manual_seed(0)
    whole = load_causal_lm(tiny_model_dir, "float32").train()
    shared = copy.deepcopy(whole)
    batch = grouped_batch()
    results = []
    for model, compute in ((whole, Compute()), (shared, Compute(shared_prefix=True))):
        routing = RoutingController(model)
        calls = counting(model)
        forward = sequence_logprobs(model, batch, routing, capture=True, compute=compute, entropy_grad=True)
        loss = -(forward.logprobs * batch.loss_mask).sum() - 0.1 * (forward.entropy_per_token * batch.loss_mask).sum()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results.append((forward, grads, calls))
        routing.close()
    (plain, plain_grads, plain_calls), (mine, my_grads, my_calls) = results
    rows, width = batch.input_ids.shape
    assert plain_calls == [rows * width]
    assert my_calls == [3 * 4, rows * (width - 4)]  # three distinct prefixes of 4, then every row's rest
    mask = batch.loss_mask
    assert float((plain.logprobs - mine.logprobs)[mask].abs().max()) < 1e-5
    assert float((plain.entropy_per_token - mine.entropy_per_token)[mask].abs().max()) < 1e-5
    assert torch.equal(plain.routing[batch.attention_mask.bool()], mine.routing[batch.attention_mask.bool()])
    for name, grad in plain_grads.items():
        scale = float(grad.abs().max())
        assert scale > 0, name
        assert float((grad - my_grads[name]).abs().max()) <= 1e-5 * scale, name


def test_whole_rows_where_the_cache_cannot_pass(tiny_model_dir):
    model = load_causal_lm(tiny_model_dir, "float32").train()
    routing = RoutingController(model)
    batch = grouped_batch()
    calls = counting(model)
    on = Compute(shared_prefix=True)
    with torch.no_grad():
        captured = sequence_logprobs(model, batch, routing, capture=True, compute=on).routing
        sequence_logprobs(model, batch, compute=on)
        assert len(calls) == 4  # shared: two calls each
        sequence_logprobs(model, batch, routing, replay=captured, replay_mask=batch.attention_mask, compute=on)
        sequence_logprobs(model, batch, compute=on, share_prefix=False)  # a replay around the caller's block
        sequence_logprobs(model, batch, compute=Compute(shared_prefix=True, exact=True))
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        sequence_logprobs(model, batch, compute=on)
    assert len(calls) == 4 + 4  # replayed, replay outside, exact, checkpointing: whole rows, one call each
    routing.close()


class OtherCache(torch.nn.Module):
    """A model whose cache is no DynamicCache (as a hybrid or static one would be)."""

    def __init__(self, inner) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, **kwargs):
        out = self.inner(**kwargs)
        if kwargs.get("use_cache"):
            out.past_key_values = tuple(out.past_key_values.layers)
        return out


def test_a_cache_that_cannot_be_gathered_runs_whole_rows_from_then_on(tiny_model_dir):
    inner = load_causal_lm(tiny_model_dir, "float32").eval()
    model = OtherCache(inner)
    routing = RoutingController(inner)
    batch = grouped_batch()
    calls = counting(model)
    on = Compute(shared_prefix=True)
    with torch.no_grad():
        plain = sequence_logprobs(inner, batch, routing, capture=True)
        first = sequence_logprobs(model, batch, routing, capture=True, compute=on)
        again = sequence_logprobs(model, batch, routing, capture=True, compute=on)
    rows, width = batch.input_ids.shape
    assert calls == [3 * 4, rows * width, rows * width]  # the prefix tried once, then whole rows
    for forward in (first, again):
        assert torch.equal(forward.logprobs, plain.logprobs) and torch.equal(forward.routing, plain.routing)
    routing.close()


@pytest.mark.parametrize("config", [StepConfig(), StepConfig(mini_batches=2, replay="r2")])
def test_a_step_with_a_shared_prefix_is_the_step_with_whole_rows(tiny_model_dir, config):
    torch.manual_seed(0)
    base = load_causal_lm(tiny_model_dir, "float32").train()
    batch = grouped_batch(seed=3)
    out = []
    for compute in (Compute(), Compute(shared_prefix=True)):
        model = copy.deepcopy(base)
        routing = RoutingController(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        metrics = train_step(model, optimizer, routing, batch, GROUP, config, 0, compute=compute)
        out.append((metrics, {n: p.detach().clone() for n, p in model.named_parameters()}))
        routing.close()
    (plain, plain_weights), (mine, my_weights) = out
    for key in ("loss", "mismatch_kl_k3", "entropy", "grad_norm", "is_weight_mean", "tokens"):
        assert mine[key] == pytest.approx(plain[key], rel=1e-4, abs=1e-7), key
    moved = max(float((plain_weights[n] - base.state_dict()[n]).abs().max()) for n in plain_weights)
    worst = max(float((plain_weights[n] - my_weights[n]).abs().max()) for n in plain_weights)
    assert moved > 5e-5 and worst < 0.05 * moved
