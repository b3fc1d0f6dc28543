"""Every number that enters the loss is checked where it enters, in the dtype the loss holds it in:
a reward of 1e39 (finite as the float64 of the wire, inf as the trainer's float32), ±3e38 (finite
in float32, but a group's sum overflows), a logprob of -3e38 — each refused with its reason, in the
batched check and the one-by-one check alike. A failed reward is left out of the loss and of its
group's baseline; a group with too few rewards is dropped; dynamic sampling over groups of one is
refused when the settings load."""

import dataclasses
import math

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from services.trainer.batch import collate
from services.trainer.config import TrainerSettings
from services.trainer.global_step import StepConfig, step_advantages
from shared.core.advantages import group_advantages
from shared.rollouts.record import (
    MAX_REWARD,
    RolloutError,
    RolloutLimits,
    decode_rollout,
    encode_rollout,
    surely_valid,
    validate_rollout,
)
from shared.rollouts.samples import scored_problem
from tests.unit.test_group_buffer import rollout

LIMITS = RolloutLimits(vocab_size=16, max_total_tokens=64)


@pytest.mark.parametrize(
    "changes, reason",
    [
        ({"reward": 1e39}, "nonfinite_reward"),  # a judge's verdict: inf in float32
        ({"reward": 3e38}, "nonfinite_reward"),  # finite in float32; a group mean of eight overflows
        ({"reward": -3e38}, "nonfinite_reward"),
        ({"reward": MAX_REWARD * 1.01}, "nonfinite_reward"),
        ({"reference_reward": 1e39}, "nonfinite_reward"),
        ({"inference_logprobs": np.array([-3e38, -0.1], dtype=np.float32)}, "logprob_range"),
        ({"inference_logprobs": np.array([-1.5e4, -0.1], dtype=np.float32)}, "logprob_range"),
        ({"teacher_logprobs": np.array([-3e38, -0.1], dtype=np.float32)}, "teacher_logprobs"),
        ({"teacher_logprobs": np.array([-0.5, 0.5], dtype=np.float32)}, "teacher_logprobs"),
        (
            {
                "teacher_top_ids": np.array([[1, 2], [3, 4]], dtype=np.int32),
                "teacher_top_logprobs": np.array([[-0.1, -3e38], [-0.1, -3.0]], dtype=np.float32),
            },
            "teacher_top",
        ),
    ],
)
def test_a_number_outside_what_the_loss_can_hold_is_refused_where_it_enters(changes, reason):
    bad = dataclasses.replace(rollout("t1", 0), **changes)
    wired = decode_rollout(encode_rollout(bad))  # as the trainer reads it off the stream
    with pytest.raises(RolloutError) as error:
        validate_rollout(wired, LIMITS)
    assert error.value.reason == reason
    assert surely_valid([rollout("t1", 1), wired], LIMITS)[1] is False  # the batched check never vouches for it


def test_values_at_the_bounds_pass():
    edge = dataclasses.replace(
        rollout("t1", 0),
        reward=-MAX_REWARD,
        inference_logprobs=np.array([-1e4, 0.0], dtype=np.float32),
        teacher_logprobs=np.array([-1e4, -0.0], dtype=np.float32),
    )
    assert validate_rollout(decode_rollout(encode_rollout(edge)), LIMITS).reward == -MAX_REWARD
    plain = [rollout("t1", i) for i in range(4)]
    assert surely_valid(plain, LIMITS) == [True] * 4


def test_a_failed_reward_leaves_the_loss_and_its_group_s_baseline():
    """Group of 4, sample 2's reward failed (it carries its reason, value 0): the baseline is the
    mean of the three that scored, sample 2's advantage is 0 and its tokens leave the loss mask."""
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    scored = torch.tensor([[True, True, False, True]])
    assert group_advantages(rewards, "mean", scored=scored)[0].tolist() == pytest.approx([1 / 3, -2 / 3, 0, 1 / 3])
    std = math.sqrt(((1 / 3) ** 2 * 2 + (2 / 3) ** 2) / 2)  # unbiased over the three that scored
    expected = [(1 - 2 / 3) / (std + 1e-6), (0 - 2 / 3) / (std + 1e-6), 0.0, (1 - 2 / 3) / (std + 1e-6)]
    assert group_advantages(rewards, "std", scored=scored)[0].tolist() == pytest.approx(expected, rel=1e-5)
    assert group_advantages(rewards, "loo", scored=scored)[0].tolist() == pytest.approx([0.5, -1.0, 0.0, 0.5])
    lone = torch.tensor([[True, False, False, False]])  # no baseline from one
    for mode in ("mean", "std", "loo"):
        assert group_advantages(rewards, mode, scored=lone).abs().sum().item() == 0.0
    assert group_advantages(rewards).tolist() == group_advantages(rewards, scored=torch.ones(1, 4).bool()).tolist()

    rollouts = [rollout("t1", i, reward=float(r), group_size=4) for i, r in enumerate([1.0, 0.0, 0.0, 1.0])]
    rollouts[2] = dataclasses.replace(rollouts[2], reward_error="error:ConnectionError")
    batch = collate(rollouts)
    assert batch.scored.tolist() == [True, True, False, True]
    assert batch.loss_mask.sum(dim=1).tolist() == [2, 2, 0, 2]
    advantages = step_advantages(batch, batch.rewards, 4, StepConfig())
    assert advantages.tolist() == pytest.approx([1 / 3, -2 / 3, 0, 1 / 3])


def test_a_group_with_too_few_rewards_is_dropped():
    assert scored_problem(["", "", "timeout", ""], 2) == ""
    assert scored_problem(["", "timeout", "error:ValueError", "timeout"], 2) == (
        "1 of 4 rewards scored, 2 needed (failed: error, timeout)"
    )
    assert scored_problem(["nonfinite"], 2) == "0 of 1 rewards scored, 1 needed (failed: nonfinite)"
    assert scored_problem([""], 2) == ""  # a group of one needs its one


def test_dynamic_sampling_over_groups_of_one_is_refused_when_the_settings_load():
    with pytest.raises(ValidationError, match=r"group_size = 1 always is: every group would be filtered"):
        TrainerSettings(model_path="m", group_size=1, dynamic_sampling={"enabled": True}, unsigned_weights=True)
    TrainerSettings(model_path="m", group_size=2, dynamic_sampling={"enabled": True}, unsigned_weights=True)
    TrainerSettings(model_path="m", group_size=1, unsigned_weights=True)  # without it a group of one trains


def test_distill_max_gap_is_finite_by_default_and_refused_otherwise():
    assert math.isfinite(TrainerSettings(model_path="m", unsigned_weights=True).distill.max_gap)
    for gap in (0, -1, math.inf, math.nan):
        with pytest.raises(ValidationError, match="max_gap"):
            TrainerSettings(model_path="m", distill={"max_gap": gap}, unsigned_weights=True)
