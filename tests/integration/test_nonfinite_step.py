"""The trainer never applies a non-finite update. A step whose inputs, loss or gradient norm are not
finite raises NonFiniteStep with the weights and the optimizer's state exactly as they were — also
with N = 2 mini-batches, where the first update was applied before the second turned out non-finite
(undone from the step's snapshot). The trainer then dead-letters the step's rollouts as
`nonfinite_step`, counts the step, publishes no version and trains the next batch."""

import asyncio
import dataclasses

import pytest
import torch
from prometheus_client import REGISTRY

from services.trainer.batch import collate
from services.trainer.global_step import NonFiniteStep, StepConfig, train_step
from shared.models import load_causal_lm
from shared.models.routing import RoutingController
from tests.integration.test_trainer import GROUP, recorded_rollouts


def bits(model, optimizer) -> tuple[list[torch.Tensor], dict]:
    """Every parameter's bits and the optimizer's state, copied (NaN compares equal to itself)."""
    params = [p.detach().clone().view(torch.int32) for p in model.parameters()]
    state = {
        i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
        for i, s in enumerate(optimizer.state.values())
    }
    return params, state


def same(a, b) -> bool:
    (params_a, state_a), (params_b, state_b) = a, b
    if len(state_a) != len(state_b) or not all(torch.equal(x, y) for x, y in zip(params_a, params_b, strict=True)):
        return False
    return all(
        torch.equal(state_a[i][k], state_b[i][k]) if torch.is_tensor(state_a[i][k]) else state_a[i][k] == state_b[i][k]
        for i in state_a
        for k in state_a[i]
    )


@pytest.fixture(scope="module")
def rollouts(tiny_model_dir):
    return recorded_rollouts(tiny_model_dir, 4)


def model_and_optimizer(model_dir, lr: float):
    torch.manual_seed(0)
    model = load_causal_lm(model_dir, "float32").train()
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


def test_a_nan_weight_fails_the_step_before_anything_changes(tiny_model_dir, rollouts):
    model, optimizer = model_and_optimizer(tiny_model_dir, 1e-3)
    train_step(model, optimizer, RoutingController(model), collate(rollouts), GROUP, StepConfig(), 1)  # state exists
    with torch.no_grad():
        model.lm_head.weight[3, 5] = float("nan")  # a diverged model: every loss is NaN from here
    before = bits(model, optimizer)
    with pytest.raises(NonFiniteStep, match="not finite"):
        train_step(model, optimizer, RoutingController(model), collate(rollouts), GROUP, StepConfig(), 2)
    assert same(before, bits(model, optimizer))
    assert all(p.grad is None for p in model.parameters())


def test_non_finite_rewards_or_advantages_fail_the_step_before_any_forward(tiny_model_dir, rollouts):
    model, optimizer = model_and_optimizer(tiny_model_dir, 1e-3)
    before = bits(model, optimizer)
    batch = collate(rollouts)
    batch = dataclasses.replace(batch, rewards=batch.rewards.clone().index_fill_(0, torch.tensor([5]), float("inf")))
    with pytest.raises(NonFiniteStep, match="the step's advantages are not all finite"):
        train_step(model, optimizer, RoutingController(model), batch, GROUP, StepConfig(), 1)
    assert same(before, bits(model, optimizer))


def test_a_later_mini_batch_that_turns_non_finite_undoes_the_step_s_earlier_updates(tiny_model_dir, rollouts):
    """lr 1e30: the first of two updates is finite and applied; the weights it leaves give a
    non-finite second mini-batch. The step is not applied: weights and Adam state as before it."""
    model, optimizer = model_and_optimizer(tiny_model_dir, 1e-3)
    config = StepConfig(mini_batches=2)
    train_step(model, optimizer, RoutingController(model), collate(rollouts), GROUP, config, 1)  # an Adam state
    for group in optimizer.param_groups:
        group["lr"] = 1e30
    before = bits(model, optimizer)
    with pytest.raises(NonFiniteStep):
        train_step(model, optimizer, RoutingController(model), collate(rollouts), GROUP, config, 2)
    assert same(before, bits(model, optimizer))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    for group in optimizer.param_groups:  # and the model trains on from there
        group["lr"] = 1e-3
    metrics = train_step(model, optimizer, RoutingController(model), collate(rollouts), GROUP, config, 2)
    assert torch.isfinite(torch.tensor(metrics["loss"])) and not same(before, bits(model, optimizer))


def test_the_trainer_dead_letters_a_non_finite_step_and_trains_the_next(
    tmp_path, tiny_model_dir, redis_server, run_id, rollouts
):
    from tests.integration.test_trainer import trainer_holding

    def counted() -> float:
        return REGISTRY.get_sample_value("steadyrl_trainer_nonfinite_steps_total") or 0.0

    async def main():
        redis, trainer = await trainer_holding(tmp_path, tiny_model_dir, redis_server, run_id, rollouts)
        lm_head = trainer.runner.model.lm_head.weight
        kept = lm_head.detach().clone()
        with torch.no_grad():
            lm_head[0, 0] = float("nan")  # the model diverged
        before = counted()
        first = await trainer.step(trainer.buffer.complete()[:2])
        after_bad = (trainer.state.step, trainer.state.version, counted() - before)
        same_weights = torch.equal(lm_head.detach().view(torch.int32)[1:], kept.view(torch.int32)[1:])
        dead = await redis.xrange(trainer.source.keys.rollouts_dead)
        reasons = await redis.hgetall(trainer.source.keys.rollouts_dead_counts)
        with torch.no_grad():
            lm_head.copy_(kept)  # the operator resumed from the checkpoint before it
        second = await trainer.step(trainer.buffer.complete()[:2])
        await trainer.close()
        await redis.aclose()
        return first, after_bad, same_weights, dead, reasons, second, (trainer.state.step, trainer.state.version)

    first, after_bad, same_weights, dead, reasons, second, after_good = asyncio.run(asyncio.wait_for(main(), 300))
    assert first == {"nonfinite_step": 1.0}
    assert after_bad == (0, 0, 1.0)  # no step, no version, one counted
    assert same_weights
    assert len(dead) == 2 * GROUP and {f[b"reason"] for _, f in dead} == {b"nonfinite_step"}
    assert all(f[b"message"].startswith(b"step not applied: ") for _, f in dead)
    assert reasons[b"nonfinite_step"] == str(2 * GROUP).encode()
    assert second["step"] == 1 and after_good == (1, 1) and second["reward_mean"] >= 0
