"""On-policy distillation as a per-token advantage: the student samples, a teacher scores every
sampled token, and each token's advantage is the negative reverse KL's sample,
log π_teacher(y_t) − log μ(y_t), optionally plus the task's sequence advantage by a weight.

μ is the policy that sampled the token (its logprob travels on the rollout), so the estimate is exact
for the behaviour policy; the trainer's Eq. 7 machinery then corrects μ → π_θ (the truncated IS
weight, version-aware staleness, clipping, R2/R3) as it does for any advantage.

Details: docs/concepts/objective.md"""

from __future__ import annotations

import torch


def distillation_advantages(
    teacher_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
    sequence_advantages: torch.Tensor | None = None,
    reward_weight: float = 0.0,
    max_gap: float = 0.0,
) -> torch.Tensor:
    """[B, T] advantages: coef · (log π_teacher − log μ) on the valid tokens (0 elsewhere, and where
    either logprob is not finite), clamped to ±max_gap when it is > 0, plus reward_weight · Â (a [B]
    sequence advantage) on them."""
    valid = mask.bool() & torch.isfinite(teacher_logprobs) & torch.isfinite(behaviour_logprobs)
    gap = torch.where(valid, teacher_logprobs - behaviour_logprobs, torch.zeros_like(teacher_logprobs))
    if max_gap > 0:  # a token the teacher all but rules out (log π_teacher ≈ −30) would drown the rest
        gap = gap.clamp(-max_gap, max_gap)
    advantages = coef * gap
    if sequence_advantages is not None and reward_weight:
        advantages = advantages + reward_weight * torch.where(
            valid, sequence_advantages.unsqueeze(-1).expand_as(gap), torch.zeros_like(gap)
        )
    return advantages
