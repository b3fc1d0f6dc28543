"""Exact, hand-computed numbers for every objective and correction in shared.core.

The shared example (B = 2 sequences, T = 2 tokens), probabilities per token:

              π_θ    π_old   μ_old   Â     r=π_θ/π_old  ρ=π_θ/μ_old  k=π_old/μ_old
  seq0 t0     0.5    0.5     0.5    +1     1.0          1.0          1.0
  seq0 t1     0.8    0.5     0.4    +1     1.6 (clip)   2.0          1.25
  seq1 t0     0.3    0.5     0.5    −1     0.6 (clip)   0.6          1.0
  seq1 t1     0.9    0.9     0.1    −1     1.0          9.0 (→5)     9.0
"""

import math

import pytest
import torch
from torch.testing import assert_close

from shared.core import LossConfig, policy_loss

L = math.log
PI_THETA = [[0.5, 0.8], [0.3, 0.9]]
PI_OLD = [[0.5, 0.5], [0.5, 0.9]]
MU_OLD = [[0.5, 0.4], [0.5, 0.1]]
ADV = [1.0, -1.0]


def _logs(values):
    return torch.tensor(values, dtype=torch.float64).log()


def run(config, pi_theta=PI_THETA, pi_old=PI_OLD, mu=MU_OLD, adv=ADV, mask=None, **kwargs):
    trainer = _logs(pi_theta).requires_grad_(True)
    old = None if pi_old is None else _logs(pi_old)
    inference = mu if isinstance(mu, torch.Tensor) else _logs(mu)
    mask = torch.ones(2, 2, dtype=torch.bool) if mask is None else mask
    loss, metrics = policy_loss(trainer, old, inference, torch.tensor(adv, dtype=torch.float64), mask, config, **kwargs)
    loss.backward()
    return loss, metrics, trainer.grad


def test_minirl_default_loss_gradient_and_metrics():
    loss, metrics, grad = run(LossConfig())
    # Surviving tokens: seq0 t0 (w=1, Â=+1) and seq1 t1 (w=min(9,5)=5, Â=−1); 4 valid tokens.
    assert_close(loss, torch.tensor(-(L(0.5) - 5 * L(0.9)) / 4, dtype=torch.float64))
    assert_close(grad, torch.tensor([[-0.25, 0.0], [0.0, 1.25]], dtype=torch.float64))
    assert_close(metrics["is_weight_mean"].item(), (1 + 2 + 0.6 + 5) / 4)
    assert metrics["is_weight_max"].item() == pytest.approx(5.0)
    assert metrics["is_truncated_frac"].item() == pytest.approx(0.25)
    assert metrics["clip_frac"].item() == pytest.approx(0.5)
    assert metrics["mismatch_kl_k1"].item() == pytest.approx((L(0.4 / 0.5) + L(0.1 / 0.9)) / 4)
    k3 = ((1.25 - 1) - L(1.25) + (9 - 1) - L(9)) / 4
    assert metrics["mismatch_kl_k3"].item() == pytest.approx(k3)
    assert metrics["valid_tokens"].item() == 4
    # first-order error per sequence: |Πρ − (1 + Σ(ρ−1))| = |2 − 2| = 0 and |5.4 − 8.6| = 3.2
    assert metrics["first_order_error"].item() == pytest.approx((0.0 + 3.2) / 2)


def test_minirl_without_clipping():
    loss, _, grad = run(LossConfig(clip=False))
    expected = -(L(0.5) + 2 * L(0.8) - 0.6 * L(0.3) - 5 * L(0.9)) / 4
    assert_close(loss, torch.tensor(expected, dtype=torch.float64))
    assert_close(grad, torch.tensor([[-0.25, -0.5], [0.15, 1.25]], dtype=torch.float64))


def test_minirl_without_train_infer_is_has_unit_weight():
    loss, metrics, _ = run(LossConfig(train_infer_is=False))
    assert_close(loss, torch.tensor(-(L(0.5) - L(0.9)) / 4, dtype=torch.float64))
    assert metrics["is_weight_mean"].item() == 1.0
    assert metrics["is_weight_max"].item() == 1.0
    assert metrics["is_truncated_frac"].item() == 0.0


def test_minirl_length_normalised():
    loss, _, _ = run(LossConfig(normalization="sequence"))
    expected = -((L(0.5) + 0) / 2 + (0 - 5 * L(0.9)) / 2) / 2
    assert_close(loss, torch.tensor(expected, dtype=torch.float64))


def test_token_normalizer_overrides_the_batch_count():
    loss, _, _ = run(LossConfig(), token_normalizer=10)
    assert_close(loss, torch.tensor(-(L(0.5) - 5 * L(0.9)) / 10, dtype=torch.float64))


def test_bypass_mode_uses_inference_logprobs_as_old():
    # π_old := μ_old: r = ρ = [[1, 2], [0.6, 9]]. seq0 t1 (Â>0, r=2) and seq1 t0 (Â<0, r=.6) clip.
    loss, metrics, _ = run(LossConfig(), pi_old=None)
    assert_close(loss, torch.tensor(-(L(0.5) - 5 * L(0.9)) / 4, dtype=torch.float64))
    assert metrics["clip_frac"].item() == pytest.approx(0.5)
    assert metrics["importance_ratio_mean"].item() == pytest.approx((1 + 2 + 0.6 + 9) / 4)


def test_sequence_level_tis():
    # seq0: Πρ = 2 → w = 2; seq1: Πρ = 5.4 → w = 5 for both tokens.
    loss, metrics, _ = run(LossConfig(is_level="sequence"))
    assert_close(loss, torch.tensor(-(2 * L(0.5) - 5 * L(0.9)) / 4, dtype=torch.float64))
    assert metrics["is_truncated_frac"].item() == pytest.approx(0.5)
    assert metrics["is_weight_mean"].item() == pytest.approx((2 + 2 + 5 + 5) / 4)


def test_sequence_mis_rejects_whole_sequences():
    # k products: seq0 1.25 ≤ 2 (kept), seq1 9 > 2 (rejected). The denominator keeps all 4 tokens.
    loss, metrics, grad = run(LossConfig(rejection="seq_mis"))
    assert_close(loss, torch.tensor(-L(0.5) / 4, dtype=torch.float64))
    assert metrics["rejected_frac"].item() == pytest.approx(0.5)
    assert grad[1].abs().sum().item() == 0.0


def test_geometric_mask():
    # geometric means of k: seq0 sqrt(1.25) = 1.118 (inside [0.9, 1.2]), seq1 3.0 (outside).
    loss, metrics, _ = run(LossConfig(rejection="geo", rejection_bounds=(0.9, 1.2)))
    assert_close(loss, torch.tensor(-L(0.5) / 4, dtype=torch.float64))
    assert metrics["rejected_frac"].item() == pytest.approx(0.5)


def test_icepop_token_mask():
    # keep tokens with 1.1 ≤ k ≤ 10: seq0 t1 (k=1.25, but clipped) and seq1 t1 (k=9).
    loss, metrics, _ = run(LossConfig(rejection="icepop", rejection_bounds=(1.1, 10.0)))
    assert_close(loss, torch.tensor(5 * L(0.9) / 4, dtype=torch.float64))
    assert metrics["rejected_frac"].item() == pytest.approx(0.5)


def test_icepop_default_bounds_drop_the_k9_token():
    loss, _, _ = run(LossConfig(rejection="icepop"))
    assert_close(loss, torch.tensor(-L(0.5) / 4, dtype=torch.float64))


def test_grpo_ppo_min_with_sequence_mean():
    loss, metrics, grad = run(LossConfig.grpo())
    # decoupled weight min(π_old/μ, 5) = [[1, 1.25], [1, 5]]; min(r·Â, clip(r)·Â):
    # seq0: [1, 1.27], seq1: [−0.8, −1] → per-sequence means 1.29375, −2.9.
    expected = -((1 * 1 + 1.25 * 1.27) / 2 + (1 * -0.8 + 5 * -1) / 2) / 2
    assert_close(loss, torch.tensor(expected, dtype=torch.float64))
    # d/dlogπ_θ of r = r; clipped branches are constant: only seq0 t0 and seq1 t1 carry gradient.
    assert_close(grad, torch.tensor([[-0.25, 0.0], [0.0, 1.25]], dtype=torch.float64))
    assert metrics["clip_frac"].item() == pytest.approx(0.5)


def test_grpo_without_clip_is_plain_ratio():
    loss, _, _ = run(LossConfig.grpo(clip=False, train_infer_is=False))
    expected = -((1 + 1.6) / 2 + (-0.6 - 1) / 2) / 2
    assert_close(loss, torch.tensor(expected, dtype=torch.float64))


def test_gspo_sequence_ratio_clipped_per_sequence():
    loss, metrics, grad = run(LossConfig(objective="gspo"))
    # s_i = exp(mean log π_θ/π_old): s0 = √1.6 ≈ 1.265 (under 1 + 0.27), s1 = √0.6 ≈ 0.775 (Â < 0,
    # under 1 − 0.2: the constant 0.8·Â); w_i = min(exp(mean log π_old/μ), 5): w0 = √1.25, w1 = √9 = 3
    expected = -(math.sqrt(1.25) * math.sqrt(1.6) + 3 * -0.8) / 2
    assert_close(loss, torch.tensor(expected, dtype=torch.float64))
    # ∂s0/∂log π_θ(t) = s0 / 2 per token of seq0; seq1 took the clipped (constant) branch
    g = -math.sqrt(1.25) * math.sqrt(1.6) / 2 / 2
    assert_close(grad, torch.tensor([[g, g], [0.0, 0.0]], dtype=torch.float64))
    assert metrics["clip_frac"].item() == pytest.approx(0.5)  # seq1's two tokens
    assert metrics["is_weight_max"].item() == pytest.approx(3.0)


def test_gspo_without_clip_or_correction_is_the_plain_sequence_ratio():
    loss, _, _ = run(LossConfig(objective="gspo", clip=False, train_infer_is=False))
    assert_close(loss, torch.tensor(-(math.sqrt(1.6) - math.sqrt(0.6)) / 2, dtype=torch.float64))


def test_cispo_keeps_every_token_with_a_clipped_coefficient():
    loss, metrics, grad = run(LossConfig(objective="cispo"))
    # coefficient clip(r, 0.8, 1.27) = [[1, 1.27], [0.8, 1]], w = min(π_old/μ, 5) = [[1, 1.25], [1, 5]]
    factors = [[1.0, 1.25 * 1.27], [-0.8, -5.0]]  # w · c · Â
    expected = -sum(f * L(p) for fs, ps in zip(factors, PI_THETA, strict=True) for f, p in zip(fs, ps, strict=True))
    assert_close(loss, torch.tensor(expected / 4, dtype=torch.float64))
    assert_close(grad, -torch.tensor(factors, dtype=torch.float64) / 4)  # no token leaves the gradient
    assert metrics["clip_frac"].item() == pytest.approx(0.5)  # two coefficients clipped


def test_cispo_in_bypass_clips_the_ratio_to_the_sampler():
    # π_old := μ_old: r = π_θ/μ = [[1, 2], [0.6, 9]] → c = [[1, 1.27], [0.8, 1.27]], no further weight
    loss, _, grad = run(LossConfig(objective="cispo"), pi_old=None)
    factors = [[1.0, 1.27], [-0.8, -1.27]]
    assert_close(grad, -torch.tensor(factors, dtype=torch.float64) / 4)


def test_entropy_bonus_subtracts_the_mean_entropy_of_the_valid_tokens():
    entropy = torch.tensor([[0.5, 1.0], [2.0, 0.25]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[True, True], [True, False]])
    base, _, _ = run(LossConfig(), mask=mask)
    loss, _, grad = run(LossConfig(entropy_coef=0.1), mask=mask, entropy=entropy)
    assert_close(loss, base - 0.1 * (0.5 + 1.0 + 2.0) / 3)
    assert_close(entropy.grad, torch.tensor([[-0.1 / 3, -0.1 / 3], [-0.1 / 3, 0.0]], dtype=torch.float64))
    with pytest.raises(ValueError, match="entropy"):
        run(LossConfig(entropy_coef=0.1))


def test_nonfinite_inference_logprobs_leave_numerator_and_denominator():
    for bad in (float("-inf"), float("nan"), float("inf")):
        mu = _logs(MU_OLD)
        mu[1, 1] = bad
        loss, metrics, grad = run(LossConfig(), mu=mu)
        # seq1 t1 gone: only seq0 t0 contributes; 3 valid tokens remain.
        assert_close(loss, torch.tensor(-L(0.5) / 3, dtype=torch.float64))
        assert torch.isfinite(grad).all()
        assert grad[1, 1].item() == 0.0
        assert metrics["valid_tokens"].item() == 3
        assert metrics["nonfinite_tokens"].item() == 1


def test_loss_mask_and_empty_batch():
    mask = torch.tensor([[True, False], [False, False]])
    loss, metrics, grad = run(LossConfig(), mask=mask)
    assert_close(loss, torch.tensor(-L(0.5), dtype=torch.float64))
    assert metrics["valid_tokens"].item() == 1
    loss, metrics, grad = run(LossConfig(), mask=torch.zeros(2, 2, dtype=torch.bool))
    assert loss.item() == 0.0 and grad.abs().sum().item() == 0.0
    assert metrics["is_weight_max"].item() == 0.0


def test_per_token_advantages_equal_broadcast_ones():
    per_token = [[1.0, 1.0], [-1.0, -1.0]]
    a, _, ga = run(LossConfig(), adv=per_token)
    b, _, gb = run(LossConfig())
    assert_close(a, b)
    assert_close(ga, gb)


def test_dppo_tv_masks_by_probability_moved_from_the_sampler():
    # |π_θ − μ_old| on the sampled token: seq0 t1 rose 0.4 (Â > 0, inside δ_high = 0.5: kept, where
    # MiniRL's ratio clip drops it); seq1 t0 fell 0.2 (Â < 0, past δ_low = 0.1: out); seq1 t1 rose
    # 0.8 but Â < 0 pushes it down: kept, with w = min(9, 5)
    config = LossConfig(objective="dppo", dppo_delta_low=0.1, dppo_delta_high=0.5)
    loss, metrics, grad = run(config)
    assert_close(loss, torch.tensor(-(L(0.5) + 2 * L(0.8) - 5 * L(0.9)) / 4, dtype=torch.float64))
    assert_close(grad, torch.tensor([[-0.25, -0.5], [0.0, 1.25]], dtype=torch.float64))
    assert metrics["clip_frac"].item() == pytest.approx(0.25)
    # anchored to μ_old, not π_old: the same tokens whatever π_old is
    assert_close(run(config, pi_old=None)[0], loss)


def test_dppo_binary_kl_and_without_its_mask():
    # KL(Bern(0.4) ‖ Bern(0.8)) = 0.382 > 0.15: seq0 t1 out; KL(Bern(0.5) ‖ Bern(0.3)) = 0.087: seq1 t0 in
    loss, metrics, grad = run(LossConfig(objective="dppo", dppo_divergence="kl"))
    assert_close(loss, torch.tensor(-(L(0.5) - 0.6 * L(0.3) - 5 * L(0.9)) / 4, dtype=torch.float64))
    assert_close(grad, torch.tensor([[-0.25, 0.0], [0.15, 1.25]], dtype=torch.float64))
    assert metrics["clip_frac"].item() == pytest.approx(0.25)
    unmasked = run(LossConfig(objective="dppo", clip=False))  # plain truncated-IS policy gradient
    assert_close(unmasked[0], run(LossConfig(clip=False))[0])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"objective": "ppo"}, "objective"),
        ({"normalization": "seq"}, "normalization"),
        ({"tis_cap": 0.0}, "tis_cap"),
        ({"eps_low": 1.5}, "eps_low"),
        ({"rejection": "mask"}, "rejection"),
        ({"dppo_divergence": "js"}, "dppo_divergence"),
        ({"dppo_delta_low": 0.0}, "dppo_delta_low"),
    ],
)
def test_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LossConfig(**kwargs)


def test_shape_errors_are_clear():
    lp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="inference_logprobs has shape"):
        policy_loss(lp, None, torch.zeros(2, 2), torch.zeros(2), torch.ones(2, 3, dtype=torch.bool), LossConfig())
    with pytest.raises(ValueError, match="advantages must be"):
        policy_loss(lp, None, lp, torch.zeros(3), torch.ones(2, 3, dtype=torch.bool), LossConfig())
