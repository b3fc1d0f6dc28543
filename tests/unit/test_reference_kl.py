"""KL to a reference policy: the k1/k2/k3 estimators, the loss term and its gradient, the reward
penalty, each equal to the formula worked by hand on a 3-token case."""

import math

import pytest
import torch

from shared.core.loss import LossConfig, policy_loss
from shared.core.reference_kl import kl_terms, reward_penalty

# one sequence of 3 tokens: π(y_t) and π_ref(y_t); r_t = log π_ref − log π = log [0.5, 1, 0.5]
PI = [0.5, 0.25, 0.8]
REF = [0.25, 0.25, 0.4]
LN2 = math.log(2)


def test_estimators_by_hand():
    pi, ref = torch.log(torch.tensor([PI])), torch.log(torch.tensor([REF]))
    assert kl_terms(pi, ref, "k1")[0].tolist() == pytest.approx([LN2, 0.0, LN2], abs=1e-6)
    assert kl_terms(pi, ref, "k2")[0].tolist() == pytest.approx([LN2**2 / 2, 0.0, LN2**2 / 2], abs=1e-6)
    # k3 = e^r − r − 1 = 0.5 + ln 2 − 1
    assert kl_terms(pi, ref, "k3")[0].tolist() == pytest.approx([LN2 - 0.5, 0.0, LN2 - 0.5], abs=1e-6)
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_terms(pi, ref, "k4")


@pytest.mark.parametrize(
    ("estimator", "value", "gradient"),
    [  # β = 0.1 over N = 3 tokens; d k / d log π: k1 → 1, k2 → −r, k3 → 1 − e^r
        ("k1", 0.1 * 2 * LN2 / 3, [0.1 / 3, 0.1 / 3, 0.1 / 3]),
        ("k2", 0.1 * LN2**2 / 3, [0.1 * LN2 / 3, 0.0, 0.1 * LN2 / 3]),
        ("k3", 0.1 * 2 * (LN2 - 0.5) / 3, [0.1 * 0.5 / 3, 0.0, 0.1 * 0.5 / 3]),
    ],
)
def test_kl_in_the_loss_and_its_gradient_by_hand(estimator, value, gradient):
    logprobs = torch.log(torch.tensor([PI])).requires_grad_(True)
    mask = torch.ones(1, 3, dtype=torch.bool)
    config = LossConfig(kl_coef=0.1, kl_estimator=estimator)
    # Â = 0: the policy term is 0, what is left is β · the mean estimate
    loss, metrics = policy_loss(
        logprobs, None, logprobs.detach(), torch.zeros(1), mask, config, reference=torch.log(torch.tensor([REF]))
    )
    loss.backward()
    assert loss.item() == pytest.approx(value, abs=1e-6)
    assert logprobs.grad[0].tolist() == pytest.approx(gradient, abs=1e-6)
    assert metrics["ref_kl"].item() == pytest.approx(value / 0.1, abs=1e-6)


def test_kl_adds_to_the_objective_and_needs_a_reference():
    logprobs = torch.log(torch.tensor([PI]))
    mask = torch.tensor([[True, True, False]])  # the third token is off the mask: it leaves the KL too
    advantages = torch.tensor([1.0])
    plain, _ = policy_loss(logprobs, None, logprobs, advantages, mask, LossConfig())
    ref = torch.log(torch.tensor([REF]))
    with_kl, metrics = policy_loss(logprobs, None, logprobs, advantages, mask, LossConfig(kl_coef=0.5), reference=ref)
    assert with_kl.item() == pytest.approx(plain.item() + 0.5 * (LN2 - 0.5) / 2, abs=1e-6)
    assert metrics["ref_kl"].item() == pytest.approx((LN2 - 0.5) / 2, abs=1e-6)
    with pytest.raises(ValueError, match="reference model"):
        policy_loss(logprobs, None, logprobs, advantages, mask, LossConfig(kl_coef=0.5))
    # in the reward, the loss is the plain one
    in_reward, metrics = policy_loss(
        logprobs, None, logprobs, advantages, mask, LossConfig(kl_coef=0.5, kl_in="reward"), reference=ref
    )
    assert in_reward.item() == plain.item() and "ref_kl" not in metrics


def test_reward_penalty_by_hand():
    # two sequences: the first as above (mask all), the second with only its first token valid
    pi = torch.log(torch.tensor([PI, [0.5, 0.5, 0.5]]))
    ref = torch.log(torch.tensor([REF, [0.125, 0.5, 0.9]]))
    mask = torch.tensor([[True, True, True], [True, False, False]])
    penalty = reward_penalty(pi, ref, mask, "k3", 0.2)
    # second: r = log 0.25 → k3 = 0.25 + ln 4 − 1
    assert penalty.tolist() == pytest.approx([0.2 * 2 * (LN2 - 0.5), 0.2 * (0.25 + 2 * LN2 - 1)], abs=1e-6)


def test_settings_refuse_bad_kl():
    with pytest.raises(ValueError, match="kl_coef"):
        LossConfig(kl_coef=-1)
    with pytest.raises(ValueError, match="kl_estimator"):
        LossConfig(kl_estimator="k9")
    with pytest.raises(ValueError, match="kl_in"):
        LossConfig(kl_in="advantage")
