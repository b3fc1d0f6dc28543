"""How the policy loss is formed (`LossConfig`, [trainer.loss]) and the names its fields take: no
tensors, so that a recipe is typed without importing torch (the launcher loads one before any
service starts). The math is shared/core/terms.py and shared/core/loss.py.

Details: docs/concepts/objective.md"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

KLEstimator = Literal["k1", "k2", "k3"]
KL_ESTIMATORS = ("k1", "k2", "k3")
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
