"""Advantages and diagnostics with hand-computed numbers."""

import math

import pytest
import torch
from torch.testing import assert_close

from shared.core import (
    entropy_from_logits,
    first_order_error,
    group_advantages,
    mismatch_kl,
    routing_agreement,
)

REWARDS = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]])


def test_mean_advantages():
    assert_close(group_advantages(REWARDS), torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.25, 0.25, 0.25, -0.75]]))


def test_std_advantages_use_unbiased_std():
    # group 0: std = sqrt(1/3); group 1: std = 0.5
    out = group_advantages(REWARDS, "std", eps=0.0)
    s = math.sqrt(3) / 2
    assert_close(out, torch.tensor([[s, -s, -s, s], [0.5, 0.5, 0.5, -1.5]]))


def test_leave_one_out_advantages():
    out = group_advantages(REWARDS, "loo")
    # R_i − mean of the other three: group 0 → 1 − 1/3, 0 − 2/3
    assert_close(out, torch.tensor([[2 / 3, -2 / 3, -2 / 3, 2 / 3], [1 / 3, 1 / 3, 1 / 3, -1.0]]))


def test_uniform_groups_have_zero_advantage_and_errors_are_clear():
    assert group_advantages(torch.ones(3, 4), "std").abs().sum() == 0
    with pytest.raises(ValueError, match="num_groups, G"):
        group_advantages(torch.ones(4))
    with pytest.raises(ValueError, match="unknown advantage mode"):
        group_advantages(torch.ones(1, 4), "median")


def test_first_order_error_exact():
    # ρ = [2, 0.5]: Π = 1, 1 + Σδ = 1 + 1 − 0.5 = 1.5 → 0.5. ρ = [1, 1] → 0.
    log_ratio = torch.tensor([[math.log(2), math.log(0.5)], [0.0, 0.0]])
    out = first_order_error(log_ratio, torch.ones(2, 2, dtype=torch.bool))
    assert_close(out, torch.tensor([0.5, 0.0], dtype=torch.float64))
    # masked tokens are ignored; a huge log-ratio stays finite
    mask = torch.tensor([[True, False], [True, True]])
    big = torch.tensor([[math.log(2), 100.0], [400.0, 400.0]])
    out = first_order_error(big, mask)
    assert out[0].item() == pytest.approx(0.0)
    assert math.isfinite(out[1].item())


def test_mismatch_kl_k1_k3():
    mu = torch.tensor([[math.log(0.5), math.log(0.2)]])
    pi = torch.tensor([[math.log(0.25), math.log(0.2)]])
    k1, k3 = mismatch_kl(mu, pi, torch.ones(1, 2, dtype=torch.bool))
    assert k1.item() == pytest.approx(math.log(2) / 2)
    assert k3.item() == pytest.approx(((0.5 - 1) - math.log(0.5)) / 2)


def test_entropy_from_logits():
    logits = torch.zeros(1, 2, 4)
    logits[0, 1] = torch.tensor([100.0, 0.0, 0.0, 0.0])
    per_token = entropy_from_logits(logits)
    assert per_token[0, 0].item() == pytest.approx(math.log(4))
    assert per_token[0, 1].item() == pytest.approx(0.0, abs=1e-6)
    mask = torch.tensor([[True, False]])
    assert entropy_from_logits(logits, mask).item() == pytest.approx(math.log(4))


def test_routing_agreement_compares_sets():
    a = torch.tensor([[[0, 1], [2, 3]], [[4, 5], [6, 7]]])  # [tokens=2, layers=2, k=2]
    b = torch.tensor([[[1, 0], [2, 4]], [[4, 5], [7, 6]]])
    assert routing_agreement(a, b).item() == pytest.approx(3 / 4)
    assert routing_agreement(a, b, torch.tensor([True, False])).item() == pytest.approx(1 / 2)
    with pytest.raises(ValueError, match="shapes differ"):
        routing_agreement(a, b[:1])


def test_pass_at_k_by_hand():
    from shared.core.evals import pass_at_k, sampled_scores

    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 − C(3,2)/C(4,2) = 1 − 3/6
    assert pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)  # 1 − C(2,2)/C(4,2)
    assert pass_at_k(4, 0, 3) == 0.0 and pass_at_k(4, 2, 3) == 1.0  # fewer wrong samples than k: certain
    assert pass_at_k(5, 3, 1) == pytest.approx(0.6)  # k = 1: the share correct
    assert sampled_scores([(4, 1), (4, 4), (4, 0)], 4) == pytest.approx({"pass_at_k": 2 / 3, "mean_at_k": 5 / 12})
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(2, 1, 3)
