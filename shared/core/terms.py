"""What every objective reads and the corrections it applies (shared by shared.core.loss's objectives),
under the loss configuration (shared.core.loss_config): the sanitised per-token terms, the truncated
IS weight, the mismatch rejection masks, the normaliser.

Shapes: logprobs float [B, T]; advantages [B] or [B, T]; loss_mask bool [B, T]. `trainer_logprobs` = log π_θ (with
gradient), `old_logprobs` = log π_old (None = bypass mode, π_old := μ_old), `inference_logprobs` = log μ_old.
Normaliser "tokens": the valid tokens of the update's mini-batch summed over data-parallel ranks
(`token_normalizer`); "sequence": length normalisation, an ablation.

Details: docs/internals/trainer.md"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shared.core import corrections
from shared.core.loss_config import LossConfig


@dataclass
class TokenTerms:
    """What every objective reads, sanitised: [B, T] each, zero where `mask` is False, so a masked
    position never turns 0·inf into NaN in the graph. Ratios are detached (they enter the loss
    under stop-gradient); `trainer` carries the gradient."""

    mask: torch.Tensor  # valid: in the loss mask with finite logprobs everywhere
    trainer: torch.Tensor  # log π_θ
    old: torch.Tensor  # log π_old (= log μ_old in bypass mode)
    inference: torch.Tensor  # log μ_old
    advantages: torch.Tensor  # Â, broadcast per token
    bypass: bool

    @property
    def log_ratio(self) -> torch.Tensor:
        """log π_θ/μ_old (Eq. 7's IS ratio)."""
        return self.trainer.detach() - self.inference

    @property
    def ratio(self) -> torch.Tensor:
        """r_t = π_θ/π_old (staleness; decides the clip mask)."""
        return torch.exp(self.trainer.detach() - self.old)

    @property
    def log_discrepancy(self) -> torch.Tensor:
        """log k_t = log π_old/μ_old; in bypass mode (π_old := μ_old) log π_θ/μ_old instead."""
        return self.log_ratio if self.bypass else self.old - self.inference


def token_terms(
    trainer_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    inference_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
) -> TokenTerms:
    check_shapes(trainer_logprobs, old_logprobs, inference_logprobs, advantages, loss_mask)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1).expand_as(trainer_logprobs)
    finite = torch.isfinite(inference_logprobs) & torch.isfinite(trainer_logprobs.detach())
    if old_logprobs is not None:
        finite &= torch.isfinite(old_logprobs)
    mask = loss_mask.bool() & finite
    zeros = torch.zeros_like(trainer_logprobs)
    inference = torch.where(mask, inference_logprobs.to(zeros.dtype), zeros.detach())
    old = inference if old_logprobs is None else torch.where(mask, old_logprobs.to(zeros.dtype), zeros.detach())
    return TokenTerms(
        mask,
        torch.where(mask, trainer_logprobs, zeros),
        old,
        inference,
        torch.where(mask, advantages.to(zeros.dtype), zeros.detach()),
        old_logprobs is None,
    )


@dataclass
class Parts:
    """The per-token factors an objective used: IS weight w_t, truncated?, clip keep M_t, rejection keep."""

    weight: torch.Tensor
    truncated: torch.Tensor
    clip_keep: torch.Tensor
    keep: torch.Tensor


def is_weight(log_ratio: torch.Tensor, mask: torch.Tensor, config: LossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The truncated IS weight of `log_ratio` (token or sequence level) and where it was truncated;
    1 everywhere when the training–inference IS is off."""
    if not config.train_infer_is:
        return torch.ones_like(log_ratio), torch.zeros_like(mask)
    if config.is_level == "token":
        return corrections.token_tis_weight(log_ratio, config.tis_cap), log_ratio > math.log(config.tis_cap)
    raw = corrections.sequence_log_ratio(log_ratio, mask).unsqueeze(-1).expand_as(mask)
    return corrections.sequence_tis_weight(log_ratio, mask, config.tis_cap), raw > math.log(config.tis_cap)


def rejection_mask(log_discrepancy: torch.Tensor, mask: torch.Tensor, config: LossConfig) -> torch.Tensor:
    low, high = config.bounds()
    if config.rejection == "seq_mis":
        return corrections.sequence_mis_mask(log_discrepancy, mask, low, high)
    if config.rejection == "geo":
        return corrections.geometric_mask(log_discrepancy, mask, low, high)
    if config.rejection == "icepop":
        return corrections.icepop_mask(log_discrepancy, low or 0.0, high or math.inf)
    return torch.ones_like(mask)


def normalise(
    per_token: torch.Tensor, mask: torch.Tensor, config: LossConfig, token_normalizer=None, sequence_normalizer=None
) -> torch.Tensor:
    """Σ per_token / N ("tokens"), or the mean over sequences of per-sequence means ("sequence")."""
    if config.normalization == "tokens":
        denominator = mask.sum() if token_normalizer is None else token_normalizer
        return per_token.sum() / torch.as_tensor(denominator, dtype=per_token.dtype).clamp(min=1)
    lengths = mask.sum(dim=-1)
    has_tokens = lengths > 0
    per_sequence = per_token.sum(dim=-1) / lengths.clamp(min=1)
    count = has_tokens.sum() if sequence_normalizer is None else sequence_normalizer
    return per_sequence[has_tokens].sum() / torch.as_tensor(count, dtype=per_token.dtype).clamp(min=1)


def check_shapes(
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
