"""The policy-gradient objectives: MiniRL (paper Eq. 7), GRPO (Appendix A), DPPO (arXiv
2602.04879, its binary TV / KL trust region), GSPO (arXiv 2507.18071, sequence-level ratio and
clipping) and CISPO (arXiv 2506.13585, a clipped IS coefficient under stop-gradient), over the terms and corrections of
`shared.core.terms` (token and sequence TIS, MIS, geometric and IcePop masks, the normaliser),
and `policy_loss`, the one entry the trainer calls. Shapes and names: `shared.core.terms`.
"""

from __future__ import annotations

import torch

from shared.core import corrections
from shared.core.diagnostics import loss_diagnostics, masked_mean
from shared.core.loss_config import LossConfig
from shared.core.reference_kl import kl_terms
from shared.core.stats import StepStats
from shared.core.terms import (
    Parts,
    TokenTerms,
    is_weight,
    normalise,
    rejection_mask,
    token_terms,
)

__all__ = ["LossConfig", "OBJECTIVES", "policy_loss"]


def minirl_loss(
    t: TokenTerms, config: LossConfig, token_normalizer=None, sequence_normalizer=None
) -> tuple[torch.Tensor, Parts]:
    """MiniRL, paper Eq. 7:  −Σ_t M_t · sg[min(π_θ/μ_old, C)] · Â · log π_θ(y_t)  / N.

    M_t = 0 where Â > 0 and r_t > 1+ε_high or Â < 0 and r_t < 1−ε_low (r_t = π_θ/π_old), else 1;
    N = the update's normaliser (module docstring). Returns the loss and its per-token parts."""
    clip_keep = (
        corrections.clip_mask(t.ratio, t.advantages, config.eps_low, config.eps_high)
        if config.clip
        else torch.ones_like(t.mask)
    )  # M_t
    return eq7_loss(t, config, clip_keep, token_normalizer, sequence_normalizer)


def eq7_loss(
    t: TokenTerms, config: LossConfig, clip_keep: torch.Tensor, token_normalizer=None, sequence_normalizer=None
) -> tuple[torch.Tensor, Parts]:
    """Eq. 7's body with the token mask M_t given (`clip_keep`): −Σ_t M_t · sg[w_t] · Â · log π_θ / N."""
    weight, truncated = is_weight(t.log_ratio, t.mask, config)  # sg[w_t]
    keep = rejection_mask(t.log_discrepancy, t.mask, config)
    per_token = torch.where(t.mask & keep, clip_keep * weight * t.advantages * t.trainer, torch.zeros_like(t.trainer))
    loss = -normalise(per_token, t.mask, config, token_normalizer, sequence_normalizer)
    return loss, Parts(weight, truncated, clip_keep, keep)


def grpo_loss(
    t: TokenTerms, config: LossConfig, token_normalizer=None, sequence_normalizer=None
) -> tuple[torch.Tensor, Parts]:
    """GRPO (Appendix A) with the decoupled IS weight:
    −Σ_t sg[min(π_old/μ_old, C)] · min(r_t·Â, clip(r_t, 1−ε_low, 1+ε_high)·Â) / N, r_t = π_θ/π_old
    with gradient (equal to Eq. 7's weight on-policy)."""
    weight, truncated = is_weight(t.log_discrepancy, t.mask, config)
    ratio = torch.exp(t.trainer - t.old)
    surrogate = ratio * t.advantages
    if config.clip:
        bounded = torch.clamp(ratio, 1.0 - config.eps_low, 1.0 + config.eps_high)
        surrogate = torch.minimum(surrogate, bounded * t.advantages)
    # where PPO-min takes its constant clipped branch is exactly where Eq. 7's M_t is 0
    clip_keep = (
        corrections.clip_mask(t.ratio, t.advantages, config.eps_low, config.eps_high)
        if config.clip
        else torch.ones_like(t.mask)
    )
    keep = rejection_mask(t.log_discrepancy, t.mask, config)
    per_token = torch.where(t.mask & keep, weight * surrogate, torch.zeros_like(t.trainer))
    loss = -normalise(per_token, t.mask, config, token_normalizer, sequence_normalizer)
    return loss, Parts(weight, truncated, clip_keep, keep)


def dppo_loss(
    t: TokenTerms, config: LossConfig, token_normalizer=None, sequence_normalizer=None
) -> tuple[torch.Tensor, Parts]:
    """DPPO (binary trust region):  −Σ_t M_t · sg[min(π_θ/μ_old, C)] · Â · log π_θ(y_t) / N, with
    M_t = 0 where Â > 0 and π_θ has moved up past δ_high from μ_old on the sampled token, or Â < 0
    and it has moved down past δ_low; the divergence is the probability difference ("tv") or
    the Bernoulli KL ("kl"), anchored to the sampling engine's μ_old, not π_old. `clip = False`
    removes the mask (plain IS policy gradient)."""
    clip_keep = (
        dppo_mask(t.trainer.detach(), t.inference, t.advantages, config) if config.clip else torch.ones_like(t.mask)
    )
    return eq7_loss(t, config, clip_keep, token_normalizer, sequence_normalizer)


def dppo_mask(
    logprobs: torch.Tensor, anchor_logprobs: torch.Tensor, advantages: torch.Tensor, config: LossConfig
) -> torch.Tensor:
    """DPPO's keep mask (bool [B, T]): False where the sampled token's probability left the trust
    region around the anchor in the direction the advantage pushes it."""
    p = torch.exp(logprobs)
    q = torch.exp(anchor_logprobs)
    up = p > q
    down = p < q
    if config.dppo_divergence == "tv":
        divergence = (p - q).abs()
    else:  # KL(Bernoulli(q) ‖ Bernoulli(p)), finite at the edges
        tiny = torch.finfo(p.dtype).tiny
        divergence = q * (anchor_logprobs - logprobs) + (1 - q) * (
            torch.log((1 - q).clamp(min=tiny)) - torch.log((1 - p).clamp(min=tiny))
        )
    outside = torch.where(
        advantages > 0,
        up & (divergence > config.dppo_delta_high),
        (advantages < 0) & down & (divergence > config.dppo_delta_low),
    )
    return ~outside


def gspo_loss(
    t: TokenTerms, config: LossConfig, token_normalizer=None, sequence_normalizer=None
) -> tuple[torch.Tensor, Parts]:
    """GSPO:  −Σ_i sg[w_i] · min(s_i·Â_i, clip(s_i, 1−ε_low, 1+ε_high)·Â_i) / N_seq, where
    s_i = exp(mean_t log π_θ/π_old) is the length-normalised sequence ratio (staleness: clipped
    per sequence, the gradient flows through it) and w_i = min(exp(mean_t log π_old/μ_old), C) the
    training–inference correction, decoupled as in GRPO's Appendix A form and taken at the level
    GSPO works at (1 in bypass, where π_old := μ_old). N_seq: sequences with a valid token (over
    every rank); rejected tokens leave their sequence's means."""
    keep = rejection_mask(t.log_discrepancy, t.mask, config)
    valid = t.mask & keep
    lengths = valid.sum(dim=-1).clamp(min=1)
    zeros = torch.zeros_like(t.trainer)
    log_s = torch.where(valid, t.trainer - t.old, zeros).sum(dim=-1) / lengths
    s = torch.exp(log_s)
    advantage = torch.where(valid, t.advantages, zeros).sum(dim=-1) / lengths  # Â_i (one per sequence)
    surrogate = s * advantage
    clipped = torch.zeros_like(valid[:, 0])
    if config.clip:
        bounded = torch.clamp(s.detach(), 1.0 - config.eps_low, 1.0 + config.eps_high) * advantage
        clipped = bounded < surrogate.detach()  # PPO-min takes the constant branch
        surrogate = torch.where(clipped, bounded, surrogate)  # (a tie keeps the whole gradient)
    raw_w = torch.exp(torch.where(valid, t.old - t.inference, zeros).sum(dim=-1) / lengths)
    if config.train_infer_is:
        weight = torch.clamp(raw_w, max=config.tis_cap)
        truncated = raw_w > config.tis_cap
    else:
        weight, truncated = torch.ones_like(raw_w), torch.zeros_like(clipped)
    has = valid.any(dim=-1)
    count = has.sum() if sequence_normalizer is None else sequence_normalizer
    loss = -torch.where(has, weight * surrogate, torch.zeros_like(s)).sum() / torch.as_tensor(
        count, dtype=s.dtype
    ).clamp(min=1)
    weight, truncated, clipped = (x.unsqueeze(-1).expand_as(valid) for x in (weight, truncated, clipped))
    return loss, Parts(weight, truncated & t.mask, ~clipped, keep)  # each sequence's value on its tokens


def cispo_loss(
    t: TokenTerms, config: LossConfig, token_normalizer=None, sequence_normalizer=None
) -> tuple[torch.Tensor, Parts]:
    """CISPO:  −Σ_t sg[w_t] · sg[clip(r_t, 1−ε_low, 1+ε_high)] · Â · log π_θ(y_t) / N, r_t = π_θ/π_old:
    no token leaves the loss (unlike Eq. 7's M_t), its coefficient is clipped instead; w_t =
    min(π_old/μ_old, C) corrects the training–inference discrepancy (token or sequence level,
    `is_level`; 1 in bypass, where π_old := μ_old), the clip bounds the staleness. `clip = False`:
    the coefficient is r_t itself."""
    log_k = t.old - t.inference  # log π_old/μ_old (0 in bypass)
    weight, truncated = is_weight(log_k, t.mask, config)
    ratio = t.ratio
    coefficient = torch.clamp(ratio, 1.0 - config.eps_low, 1.0 + config.eps_high) if config.clip else ratio
    keep = rejection_mask(t.log_discrepancy, t.mask, config)
    per_token = torch.where(t.mask & keep, weight * coefficient * t.advantages * t.trainer, torch.zeros_like(t.trainer))
    loss = -normalise(per_token, t.mask, config, token_normalizer, sequence_normalizer)
    return loss, Parts(weight, truncated, coefficient == ratio, keep)


OBJECTIVES = {"minirl": minirl_loss, "grpo": grpo_loss, "dppo": dppo_loss, "gspo": gspo_loss, "cispo": cispo_loss}


def policy_loss(
    trainer_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    inference_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    config: LossConfig,
    token_normalizer: float | torch.Tensor | None = None,
    sequence_normalizer: float | torch.Tensor | None = None,
    stats: StepStats | None = None,
    buckets: tuple[torch.Tensor, list[int]] | None = None,
    entropy: torch.Tensor | None = None,
    reference: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The configured objective's loss to minimise and a dict of scalar diagnostics (means over
    this call's valid tokens). With `stats`, the same diagnostics are also added there as token
    sums (whole-step statistics); `buckets` = (staleness bucket per token [B, T], bucket values)
    adds mismatch KL and IS weight per staleness bucket. Tokens whose logprobs are not finite
    leave numerator and denominator alike. `entropy` ([B, T], with its graph): the entropy bonus,
    −entropy_coef · H over the valid tokens under the objective's normaliser (off at 0).
    `reference` ([B, T] log π_ref): with kl_coef > 0 and kl_in "loss", + kl_coef · the KL
    estimate on log π_θ under the same normaliser (`ref_kl`: its mean, in the diagnostics)."""
    t = token_terms(trainer_logprobs, old_logprobs, inference_logprobs, advantages, loss_mask)
    loss, parts = OBJECTIVES[config.objective](t, config, token_normalizer, sequence_normalizer)
    if config.entropy_coef > 0:
        if entropy is None:
            raise ValueError("entropy_coef > 0 needs the token entropy (with its graph)")
        bonus = torch.where(t.mask, entropy.to(t.trainer.dtype), torch.zeros_like(t.trainer))
        loss = loss - config.entropy_coef * normalise(bonus, t.mask, config, token_normalizer, sequence_normalizer)
    kl = None
    if config.kl_coef > 0 and config.kl_in == "loss":
        if reference is None:
            raise ValueError("kl_coef > 0 with kl_in 'loss' needs the reference model's logprobs")
        ref = torch.where(t.mask, reference.to(t.trainer.dtype), t.trainer.detach())  # 0 off the mask
        kl = kl_terms(t.trainer, ref, config.kl_estimator)
        loss = loss + config.kl_coef * normalise(kl, t.mask, config, token_normalizer, sequence_normalizer)
    with torch.no_grad():
        metrics = loss_diagnostics(t, parts, loss_mask, stats, buckets)
        if kl is not None:
            metrics["ref_kl"] = masked_mean(kl.detach(), t.mask)
            if stats is not None:
                stats.add_mean("ref_kl", kl.detach(), t.mask)
    return loss, metrics
