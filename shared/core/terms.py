"""What every objective reads and the corrections it applies (shared by shared.core.loss's objectives): the loss
configuration, the sanitised per-token terms, the truncated IS weight, the mismatch rejection masks, the normaliser.

Shapes: logprobs float [B, T]; advantages [B] or [B, T]; loss_mask bool [B, T]. `trainer_logprobs` = log π_θ (with
gradient), `old_logprobs` = log π_old (None = bypass mode, π_old := μ_old), `inference_logprobs` = log μ_old.
Normaliser "tokens": the valid tokens of the update's mini-batch summed over data-parallel ranks
(`token_normalizer`); "sequence": length normalisation, an ablation.

Details: docs/internals/trainer.md"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

import torch

from shared.core import corrections
from shared.core.reference_kl import KL_ESTIMATORS, KLEstimator

Objective = Literal["minirl", "grpo", "dppo", "gspo", "cispo"]
OBJECTIVE_NAMES = ("minirl", "grpo", "dppo", "gspo", "cispo")
Divergence = Literal["tv", "kl"]
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
    """"minirl": Σ M_t·sg[w_t]·Â·log π_θ (Eq. 7); "grpo": PPO-min clipped surrogate (App. A);
    "dppo": Eq. 7 with the trust region on the sampled token's probability, not its ratio;
    "gspo": the sequence-level ratio, clipped per sequence (Qwen3's recipe); "cispo": every token
    kept, its IS coefficient clipped under stop-gradient (MiniMax-M1). shared/core/loss.py."""
    train_infer_is: bool = True
    """Apply the training–inference IS weight; False sets w_t := 1 (the paper's ablation)."""
    tis_cap: float = 5.0
    """Truncation C of the IS weight (paper: 5); > 0."""
    is_level: ISLevel = "token"
    """"token": w_t = min(ρ_t, C); "sequence": w = min(Π_t ρ_t, C) for every token of y."""
    clip: bool = True
    """MiniRL: token mask M_t; GRPO: PPO clip. False removes it (the paper's ablation)."""
    eps_low: float = 0.2
    """Lower clip range ε_low, in [0, 1)."""
    eps_high: float = 0.27
    """Upper clip range ε_high, ≥ 0."""
    normalization: Normalization = "tokens"
    """"tokens": divide by the valid tokens of the mini-batch of the update (all ranks);
    "sequence": length normalisation — per-sequence mean, then the mean over sequences (an
    ablation for MiniRL, GRPO's original form)."""
    rejection: Rejection = "none"
    """Extra mismatch rejection on k_t = π_old/μ_old: sequence MIS, geometric mean, or IcePop."""
    rejection_bounds: tuple[float | None, float | None] | None = None
    """(low, high) for `rejection`; None = DEFAULT_REJECTION_BOUNDS[rejection]."""
    dppo_divergence: Divergence = "tv"
    """DPPO's divergence between π_θ and μ_old on the sampled token: "tv" = π_θ(y) − μ_old(y);
    "kl" = the KL between Bernoulli(μ_old(y)) and Bernoulli(π_θ(y))."""
    dppo_delta_low: float = 0.15
    """DPPO: a token with Â < 0 leaves the loss once π_θ has fallen past this divergence (> 0)."""
    dppo_delta_high: float = 0.15
    """DPPO: a token with Â > 0 leaves the loss once π_θ has risen past this divergence (> 0)."""
    entropy_coef: float = 0.0
    """Entropy bonus: the loss subtracts entropy_coef × the mean token entropy of π_θ over the
    valid tokens (same normaliser); 0 = off, as in the paper. ≥ 0."""
    kl_coef: float = 0.0
    """KL to a frozen reference model (trainer.reference_model): its weight β; 0 = off (no
    reference is loaded), as in the paper. ≥ 0. shared/core/reference_kl.py."""
    kl_estimator: KLEstimator = "k3"
    """The per-token estimator of KL(π ‖ π_ref): "k1" (log-ratio), "k2" (half its square) or "k3"
    (e^r − r − 1, non-negative)."""
    kl_in: Literal["loss", "reward"] = "loss"
    """"loss": + β · the mean estimate over the valid tokens of log π_θ (same normaliser);
    "reward": each sequence's reward loses β · Σ_t of the estimate on log μ_old before the advantages."""

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVE_NAMES:
            raise ValueError(f"objective must be one of {', '.join(OBJECTIVE_NAMES)}, got {self.objective!r}")
        if self.dppo_divergence not in ("tv", "kl"):
            raise ValueError(f"dppo_divergence must be 'tv' or 'kl', got {self.dppo_divergence!r}")
        if not (self.dppo_delta_low > 0 and self.dppo_delta_high > 0):
            raise ValueError(
                f"dppo_delta_low and dppo_delta_high must be > 0, got {self.dppo_delta_low}, {self.dppo_delta_high}"
            )
        if self.normalization not in ("tokens", "sequence"):
            raise ValueError(f"normalization must be 'tokens' or 'sequence', got {self.normalization!r}")
        if self.is_level not in ("token", "sequence"):
            raise ValueError(f"is_level must be 'token' or 'sequence', got {self.is_level!r}")
        if self.rejection not in ("none", *DEFAULT_REJECTION_BOUNDS):
            raise ValueError(f"unknown rejection {self.rejection!r}")
        if not self.kl_coef >= 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator must be one of {', '.join(KL_ESTIMATORS)}, got {self.kl_estimator!r}")
        if self.kl_in not in ("loss", "reward"):
            raise ValueError(f"kl_in must be 'loss' or 'reward', got {self.kl_in!r}")
        if not self.entropy_coef >= 0:
            raise ValueError(f"entropy_coef must be >= 0, got {self.entropy_coef}")
        if not self.tis_cap > 0:
            raise ValueError(f"tis_cap must be > 0, got {self.tis_cap}")
        if not 0 <= self.eps_low < 1:
            raise ValueError(f"eps_low must lie in [0, 1), got {self.eps_low}")
        if not self.eps_high >= 0:
            raise ValueError(f"eps_high must be >= 0, got {self.eps_high}")

    @classmethod
    def grpo(cls, **overrides: object) -> LossConfig:
        """GRPO as Appendix A writes it: PPO-min clipping, per-sequence length normalisation."""
        return replace(cls(objective="grpo", normalization="sequence"), **overrides)  # type: ignore[arg-type]

    def bounds(self) -> tuple[float | None, float | None]:
        return self.rejection_bounds or DEFAULT_REJECTION_BOUNDS.get(self.rejection, (None, None))


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
