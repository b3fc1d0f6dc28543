"""On-policy distillation. As a per-token advantage: the student samples, a teacher scores every
sampled token, and each token's advantage is the negative reverse KL's sample,
log π_teacher(y_t) − log μ(y_t), optionally plus the task's sequence advantage by a weight.
μ is the policy that sampled the token (its logprob travels on the rollout), so the estimate is exact
for the behaviour policy; the trainer's Eq. 7 machinery then corrects μ → π_θ as for any advantage.

As a loss on the teacher's distribution (`top_k_kl`): at every sampled position, the KL from the
teacher's k most likely tokens, plus one bucket for the rest, to π_θ's probabilities of the same.

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
    max_gap: float = 10.0,
) -> torch.Tensor:
    """[B, T] advantages: coef · (log π_teacher − log μ) on the valid tokens (0 elsewhere, and where
    either logprob is not finite), clamped to ±max_gap (finite, > 0), plus reward_weight · Â (a [B]
    sequence advantage) on them."""
    if not 0 < max_gap < float("inf"):
        raise ValueError(f"max_gap must be finite and > 0, got {max_gap}")
    valid = mask.bool() & torch.isfinite(teacher_logprobs) & torch.isfinite(behaviour_logprobs)
    gap = torch.where(valid, teacher_logprobs - behaviour_logprobs, torch.zeros_like(teacher_logprobs))
    # a token the teacher all but rules out (log π_teacher ≈ −30) would drown the rest
    gap = gap.clamp(-max_gap, max_gap)
    advantages = coef * gap
    if sequence_advantages is not None and reward_weight:
        advantages = advantages + reward_weight * torch.where(
            valid, sequence_advantages.unsqueeze(-1).expand_as(gap), torch.zeros_like(gap)
        )
    return advantages


def top_k_kl(policy_top_logprobs: torch.Tensor, teacher_top_logprobs: torch.Tensor) -> torch.Tensor:
    """[B, T] KL(p_T ‖ π_θ) over the teacher's top-k tokens and one bucket for the rest, at each
    position: Σ_v p_T(v) (log p_T(v) − log π_θ(v)) + p_T(rest) (log p_T(rest) − log π_θ(rest)),
    from log π_θ at the teacher's top-k ids ([B, T, k], gradient kept) and the teacher's logprobs
    ([B, T, k]). ≥ 0, and 0 exactly where π_θ equals the teacher on the k tokens. Its gradient on a
    token is π_θ's share minus the teacher's: it does not fade where π_θ is confidently wrong."""
    tiny = torch.finfo(torch.float32).tiny
    policy = policy_top_logprobs.float()
    teacher = teacher_top_logprobs.float()
    p_teacher = teacher.exp()
    rest_teacher = (1 - p_teacher.sum(dim=-1)).clamp(min=0)
    rest_policy = (1 - policy.exp().sum(dim=-1)).clamp(min=1e-6)  # a floor: log 0 has no gradient to give
    head = (p_teacher * (teacher - policy)).sum(dim=-1)
    tail = rest_teacher * (torch.log(rest_teacher.clamp(min=tiny)) - torch.log(rest_policy))
    return head + tail
