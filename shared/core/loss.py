"""The policy-gradient objectives: MiniRL (paper Eq. 7) and GRPO (Appendix A), with the
training–inference corrections of DESIGN.md §3.

Shapes: logprobs float [B, T]; advantages [B] (one per sequence) or [B, T]; loss_mask bool [B, T].
Names say which engine produced a value: `trainer_logprobs` = log π_θ (with gradient),
`old_logprobs` = log π_old (training engine, start of the global step; None = bypass mode,
π_old := μ_old), `inference_logprobs` = log μ_old (the sampling engine).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

import torch

from shared.core import corrections
from shared.core.diagnostics import first_order_error, masked_max, masked_mean, mismatch_kl

Objective = Literal["minirl", "grpo"]
Normalization = Literal["tokens", "sequence"]
ISLevel = Literal["token", "sequence"]
Rejection = Literal["none", "seq_mis", "geo", "icepop"]

# Bounds each rejection mode uses when `rejection_bounds` is None (verl / Ring-1T presets).
DEFAULT_REJECTION_BOUNDS: dict[str, tuple[float | None, float | None]] = {
    "seq_mis": (None, 2.0),
    "geo": (0.999, 1.001),
    "icepop": (0.5, 5.0),
}


@dataclass(frozen=True)
class LossConfig:
    """How the policy loss is formed. Defaults are the paper's MiniRL recipe."""

    objective: Objective = "minirl"
    """"minirl": Σ M_t·sg[w_t]·Â·log π_θ (Eq. 7); "grpo": PPO-min clipped surrogate (App. A)."""
    train_infer_is: bool = True
    """Apply the training–inference IS weight; False sets w_t := 1 (the paper's ablation)."""
    tis_cap: float = 5.0
    """Truncation C of the IS weight (paper: 5)."""
    is_level: ISLevel = "token"
    """"token": w_t = min(ρ_t, C); "sequence": w = min(Π_t ρ_t, C) for every token of y."""
    clip: bool = True
    """MiniRL: token mask M_t; GRPO: PPO clip. False removes it (the paper's ablation)."""
    eps_low: float = 0.2
    """Lower clip range ε_low."""
    eps_high: float = 0.27
    """Upper clip range ε_high."""
    normalization: Normalization = "tokens"
    """"tokens": divide by the valid tokens of the whole batch; "sequence": per-sequence mean,
    then batch mean (length normalisation; an ablation for MiniRL, GRPO's original form)."""
    rejection: Rejection = "none"
    """Extra mismatch rejection on k_t = π_old/μ_old: sequence MIS, geometric mean, or IcePop."""
    rejection_bounds: tuple[float | None, float | None] | None = None
    """(low, high) for `rejection`; None = DEFAULT_REJECTION_BOUNDS[rejection]."""

    def __post_init__(self) -> None:
        if self.objective not in ("minirl", "grpo"):
            raise ValueError(f"objective must be 'minirl' or 'grpo', got {self.objective!r}")
        if self.normalization not in ("tokens", "sequence"):
            raise ValueError(f"normalization must be 'tokens' or 'sequence', got {self.normalization!r}")
        if self.is_level not in ("token", "sequence"):
            raise ValueError(f"is_level must be 'token' or 'sequence', got {self.is_level!r}")
        if self.rejection not in ("none", *DEFAULT_REJECTION_BOUNDS):
            raise ValueError(f"unknown rejection {self.rejection!r}")
        if not self.tis_cap > 0:
            raise ValueError(f"tis_cap must be > 0, got {self.tis_cap}")
        if not (0 <= self.eps_low < 1 and self.eps_high >= 0):
            raise ValueError(f"need 0 <= eps_low < 1 and eps_high >= 0, got {self.eps_low}, {self.eps_high}")

    @classmethod
    def grpo(cls, **overrides: object) -> LossConfig:
        """GRPO as Appendix A writes it: PPO-min clipping, per-sequence length normalisation."""
        return replace(cls(objective="grpo", normalization="sequence"), **overrides)  # type: ignore[arg-type]

    def bounds(self) -> tuple[float | None, float | None]:
        return self.rejection_bounds or DEFAULT_REJECTION_BOUNDS.get(self.rejection, (None, None))


def policy_loss(
    trainer_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    inference_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    config: LossConfig,
    token_normalizer: float | torch.Tensor | None = None,
    sequence_normalizer: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss to minimise and a dict of scalar diagnostics.

    MiniRL: loss = −Σ_t mask·M_t·sg[w_t]·Â·log π_θ(y_t) / N with w_t = min(π_θ/μ_old, C) and
    M_t from r_t = π_θ/π_old (Eq. 7). GRPO: loss = −Σ_t mask·sg[w_t]·min(r_t·Â, clip(r_t)·Â) / N
    with the decoupled weight w_t = min(π_old/μ_old, C) (equal to Eq. 7's on-policy).

    N = token_normalizer (the whole optimizer step's valid tokens, when the trainer accumulates
    micro-batches) or this batch's valid tokens; "sequence" normalisation averages per sequence
    first, over sequences with a valid token, divided by sequence_normalizer when given.
    Tokens whose inference logprob is not finite leave numerator and denominator alike.
    """
    _check_shapes(trainer_logprobs, old_logprobs, inference_logprobs, advantages, loss_mask)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1).expand_as(trainer_logprobs)
    advantages = advantages.to(trainer_logprobs.dtype)

    finite = torch.isfinite(inference_logprobs) & torch.isfinite(trainer_logprobs.detach())
    if old_logprobs is not None:
        finite &= torch.isfinite(old_logprobs)
    mask = loss_mask.bool() & finite
    zeros = torch.zeros_like(trainer_logprobs)
    # Sanitise so masked positions never turn 0·inf into NaN in the graph.
    lp_infer = torch.where(mask, inference_logprobs.to(trainer_logprobs.dtype), zeros)
    lp_old = lp_infer if old_logprobs is None else torch.where(mask, old_logprobs.to(zeros.dtype), zeros)
    lp_train = torch.where(mask, trainer_logprobs, zeros)
    lp_train_sg = lp_train.detach()

    log_ratio_full = lp_train_sg - lp_infer  # log π_θ/μ_old
    log_ratio_old = lp_train_sg - lp_old  # log r_t = log π_θ/π_old
    # Discrepancy k_t = π_old/μ_old; in bypass mode π_old := μ_old, so look at π_θ/μ_old instead.
    log_discrepancy = log_ratio_full if old_logprobs is None else lp_old - lp_infer
    ratio = torch.exp(log_ratio_old)

    # The log-ratio the IS weight truncates: the full ratio for MiniRL (Eq. 7), the decoupled
    # factor π_old/μ_old for GRPO (its r_t already carries π_θ/π_old).
    is_log_ratio = log_ratio_full if config.objective == "minirl" else log_discrepancy
    if config.train_infer_is:
        if config.is_level == "token":
            weight = corrections.token_tis_weight(is_log_ratio, config.tis_cap)
            raw = is_log_ratio
        else:
            weight = corrections.sequence_tis_weight(is_log_ratio, mask, config.tis_cap)
            raw = corrections.sequence_log_ratio(is_log_ratio, mask).unsqueeze(-1).expand_as(mask)
        truncated = raw > math.log(config.tis_cap)
    else:
        weight = torch.ones_like(lp_train_sg)
        truncated = torch.zeros_like(mask)

    keep = _rejection_mask(log_discrepancy, mask, config)
    # Where PPO-min picks its constant clipped branch is exactly where Eq. 7's M_t is 0.
    clip_keep = (
        corrections.clip_mask(ratio, advantages, config.eps_low, config.eps_high)
        if config.clip
        else torch.ones_like(mask)
    )
    if config.objective == "minirl":
        per_token = clip_keep * weight * advantages * lp_train
    else:
        ratio_grad = torch.exp(lp_train - lp_old)
        surrogate = ratio_grad * advantages
        if config.clip:
            bounded = torch.clamp(ratio_grad, 1.0 - config.eps_low, 1.0 + config.eps_high)
            surrogate = torch.minimum(surrogate, bounded * advantages)
        per_token = weight * surrogate
    contributing = mask & keep
    per_token = torch.where(contributing, per_token, zeros)

    if config.normalization == "tokens":
        denominator = mask.sum() if token_normalizer is None else token_normalizer
        objective = per_token.sum() / torch.as_tensor(denominator, dtype=per_token.dtype).clamp(min=1)
    else:
        lengths = mask.sum(dim=-1)
        has_tokens = lengths > 0
        per_sequence = per_token.sum(dim=-1) / lengths.clamp(min=1)
        count = has_tokens.sum() if sequence_normalizer is None else sequence_normalizer
        objective = per_sequence[has_tokens].sum() / torch.as_tensor(count, dtype=per_token.dtype).clamp(min=1)
    loss = -objective

    with torch.no_grad():
        k1, k3 = mismatch_kl(lp_infer, lp_old if old_logprobs is not None else lp_train_sg, mask)
        sequences = mask.any(dim=-1)
        fo_error = first_order_error(log_ratio_full, mask)
        metrics = {
            "is_weight_mean": masked_mean(weight, mask),
            "is_weight_max": masked_max(weight, mask),
            "is_truncated_frac": masked_mean(truncated.to(weight.dtype), mask),
            "clip_frac": masked_mean((~clip_keep).to(weight.dtype), mask),
            "rejected_frac": masked_mean((~keep).to(weight.dtype), mask),
            "importance_ratio_mean": masked_mean(ratio, mask),
            "mismatch_kl_k1": k1,
            "mismatch_kl_k3": k3,
            "first_order_error": masked_mean(fo_error, sequences),
            "advantage_mean": masked_mean(advantages, mask),
            "valid_tokens": mask.sum().to(weight.dtype),
            "nonfinite_tokens": (loss_mask.bool() & ~finite).sum().to(weight.dtype),
        }
    return loss, metrics


def _rejection_mask(log_discrepancy: torch.Tensor, mask: torch.Tensor, config: LossConfig) -> torch.Tensor:
    low, high = config.bounds()
    if config.rejection == "seq_mis":
        return corrections.sequence_mis_mask(log_discrepancy, mask, low, high)
    if config.rejection == "geo":
        return corrections.geometric_mask(log_discrepancy, mask, low, high)
    if config.rejection == "icepop":
        return corrections.icepop_mask(log_discrepancy, low or 0.0, high or math.inf)
    return torch.ones_like(mask)


def _check_shapes(
    trainer_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    inference_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
) -> None:
    shape = trainer_logprobs.shape
    if trainer_logprobs.dim() != 2:
        raise ValueError(f"trainer_logprobs must be [B, T], got {tuple(shape)}")
    named = {"inference_logprobs": inference_logprobs, "loss_mask": loss_mask}
    if old_logprobs is not None:
        named["old_logprobs"] = old_logprobs
    for name, tensor in named.items():
        if tensor.shape != shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {tuple(shape)}")
    if advantages.shape not in (shape, shape[:1]):
        raise ValueError(f"advantages must be [B] or [B, T], got {tuple(advantages.shape)} for {tuple(shape)}")
