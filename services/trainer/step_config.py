"""One global step's shape (`StepConfig`: advantages, π_old, mini-batches, routing replay): no tensors,
so that a recipe is typed without importing torch (the launcher loads one before any service starts).
The step itself is services/trainer/global_step.py."""

from __future__ import annotations

from dataclasses import dataclass

from shared.core.loss_config import LossConfig

REPLAY_MODES = ("off", "r2", "r3")


@dataclass(frozen=True)
class StepConfig:
    """One global step: how advantages, π_old, mini-batches and routing replay are formed."""

    loss: LossConfig = LossConfig()
    advantage: str = "mean"
    """Group baseline: "mean" (MiniRL), "std" (GRPO), "loo"."""
    mini_batches: int = 1
    """N: optimizer steps per global step (1 = on-policy)."""
    replay: str = "off"
    """Routing replay: "off", "r2" (π_old recompute's experts), "r3" (inference traces)."""
    bypass: bool = False
    """π_old := μ_old (no recompute forward)."""
    grad_clip: float = 1.0
    """Max global grad norm (0 = off)."""
    separate_old_pass: bool = False
    """Recompute π_old in a pass of its own even where the update's forward gives it (`fuses_old`)."""
    distill_coef: float = 0.0
    """On-policy distillation: per-token advantages coef · (log π_teacher − log μ) (0: off)."""
    distill_reward_weight: float = 0.0
    """... plus this weight of the task's sequence advantage."""
    distill_max_gap: float = 10.0
    """... the log-ratio clamped to ±this first (finite, > 0)."""
    distill_top_k_coef: float = 0.0
    """Weight of the KL from the teacher's top-k distribution to the policy's in the loss (0: off)."""
    exact: bool = False
    """Exact mode: π at the step's version equals μ bit for bit on every token sampled by that version,
    or the step raises ExactMismatch naming the token (docs/guides/exact.md)."""

    @property
    def distills(self) -> bool:
        """A teacher signal in the advantages or in the loss: advantages are per token."""
        return self.distill_coef > 0 or self.distill_top_k_coef > 0

    @property
    def fuses_old(self) -> bool:
        """N = 1 without bypass or R3: π_old is the model as it is before the one update, so the
        update's own forward, detached, is log π_old, and R2 would replay exactly what that forward
        routes: no separate no-grad pass (docs/internals/trainer.md)."""
        return self.mini_batches == 1 and not self.bypass and self.replay != "r3" and not self.separate_old_pass

    def __post_init__(self) -> None:
        if self.replay not in REPLAY_MODES:
            raise ValueError(f"replay must be one of {REPLAY_MODES}, got {self.replay!r}")
        if self.mini_batches < 1:
            raise ValueError("mini_batches must be >= 1")
        if self.replay == "r2" and self.bypass:
            raise ValueError("R2 replays the π_old recompute's routing: it needs bypass off")
