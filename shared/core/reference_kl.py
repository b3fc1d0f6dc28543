"""KL to a frozen reference policy π_ref: the per-token estimators k1, k2, k3 of KL(π ‖ π_ref) on
tokens sampled from π (Schulman's "Approximating KL divergence"), the penalty subtracted from the
reward, and the loss term. Off by default: the paper's recipe has no reference.

With r = log π_ref(y_t) − log π(y_t):  k1 = −r,  k2 = r² / 2,  k3 = e^r − r − 1  (≥ 0, low variance).
In the loss the estimate is taken on log π_θ (its gradient drives π_θ toward π_ref), unweighted, as
verl and TRL do; in the reward it is taken on log μ_old, the policy that sampled the tokens (exact
for k1 and k3: an unbiased estimate of KL(μ_old ‖ π_ref)), summed over the sequence.

Details: docs/concepts/objective.md"""

from __future__ import annotations

import torch

from shared.core.loss_config import KL_ESTIMATORS, KLEstimator


def kl_terms(logprobs: torch.Tensor, reference_logprobs: torch.Tensor, estimator: KLEstimator) -> torch.Tensor:
    """Per-token estimate [B, T] of KL(π ‖ π_ref) from log π (gradient kept) and log π_ref."""
    r = reference_logprobs - logprobs
    if estimator == "k1":
        return -r
    if estimator == "k2":
        return 0.5 * r * r
    if estimator == "k3":
        return torch.expm1(r) - r
    raise ValueError(f"kl estimator must be one of {', '.join(KL_ESTIMATORS)}, got {estimator!r}")


def reward_penalty(
    logprobs: torch.Tensor,
    reference_logprobs: torch.Tensor,
    mask: torch.Tensor,
    estimator: KLEstimator,
    coef: float,
) -> torch.Tensor:
    """[B] what KL-in-reward subtracts from each sequence's reward: coef · Σ_t k(t) over its valid tokens."""
    terms = kl_terms(logprobs, reference_logprobs, estimator)
    return coef * torch.where(mask, terms, torch.zeros_like(terms)).sum(dim=-1)
