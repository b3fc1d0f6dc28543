"""A failed reward is not a wrong answer. A reward that raises or returns NaN on 5 % of its calls
(seeded, in the real reward process) is called again; with retries every completion gets the value
its successful call gives, and without them the ones that failed carry their reason and leave the
loss — so the rewards a step trains on are exactly those of successful calls, and the group
baselines are formed from them alone."""

import random

import pytest
import torch

from services.trainer.batch import collate
from services.trainer.global_step import StepConfig, step_advantages
from shared.engines import Sample
from shared.rollouts.record import RolloutTimings, decode_rollout
from shared.rollouts.samples import encode_samples
from shared.rpc.steadyrl.v1 import common_pb2
from shared.tasks import RewardRunner

ANSWER = "42"


def completions(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [rng.choice(["42", "41", "42 ", "7"]) for _ in range(n)]


def truth(texts: list[str]) -> list[float]:
    return [float(t.strip() == ANSWER) for t in texts]


@pytest.mark.parametrize("reward", ["tests.rewards:flaky_exact_match", "tests.rewards:nan_sometimes"])
def test_retried_rewards_equal_the_successful_calls(reward):
    texts = completions(400)
    runner = RewardRunner(timeout=10.0, retries=3)
    try:
        scores = runner.score(reward, texts, ANSWER)
    finally:
        runner.close()
    failures = [reason for s in scores for reason in s.failures]
    assert 8 <= len(failures) <= 40  # about 5 % of 400 calls failed, each retried
    assert all(not s.reason for s in scores)  # no completion failed four calls in a row
    assert [s.value for s in scores] == truth(texts)


def test_without_retries_a_failed_reward_is_left_out_not_trained_as_zero():
    texts = completions(64, seed=1)
    runner = RewardRunner(timeout=10.0, retries=0)
    try:
        scores = runner.score("tests.rewards:flaky_exact_match", texts, ANSWER)
    finally:
        runner.close()
    failed = [i for i, s in enumerate(scores) if s.reason]
    assert failed and all(scores[i].reason == "error:ConnectionError" and scores[i].value == 0.0 for i in failed)
    # the replica publishes them with their reasons (8 tasks of 8); the trainer's batch leaves them out
    sample = Sample(token_ids=[7, 2], logprobs=[-0.5, -0.1], versions=[3, 3], finish_reason="stop")
    rollouts = []
    for g in range(8):
        task = common_pb2.PromptTask(task_id=f"t{g}", run_id="r", prompt_token_ids=[1, 5, 6])
        group = scores[g * 8 : (g + 1) * 8]
        payloads = encode_samples(
            task, [sample] * 8, [s.value for s in group], "r0", "torch", RolloutTimings(), [s.reason for s in group]
        )
        rollouts += [decode_rollout(p) for p in payloads]
    batch = collate(rollouts)
    assert sorted((~batch.scored).nonzero().flatten().tolist()) == failed
    assert batch.loss_mask[failed].sum().item() == 0
    advantages = step_advantages(batch, batch.rewards, 8, StepConfig()).view(-1, 8)
    rewards = torch.tensor(truth(texts)).view(-1, 8)
    scored = batch.scored.view(-1, 8)
    for g in range(8):  # each group's baseline: the mean of its successful calls only
        kept = rewards[g][scored[g]]
        expected = torch.where(scored[g], rewards[g] - kept.mean(), torch.zeros(8))
        assert advantages[g].tolist() == pytest.approx(expected.tolist(), abs=1e-6)


def test_a_reward_past_what_the_loss_holds_is_a_failed_reward_not_a_value():
    runner = RewardRunner(timeout=10.0, retries=1)
    try:
        [score] = runner.score("tests.rewards:huge", ["x"], "y")
    finally:
        runner.close()
    assert (score.value, score.reason, score.failures) == (0.0, "out_of_range", ("out_of_range", "out_of_range"))
