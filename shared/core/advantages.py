"""Group advantages Â(x, y) for G responses per prompt (paper Eq. 7, Appendix A)."""

from __future__ import annotations

from typing import Literal

import torch

AdvantageMode = Literal["mean", "std", "loo"]


def group_advantages(
    rewards: torch.Tensor, mode: AdvantageMode = "mean", eps: float = 1e-6, scored: torch.Tensor | None = None
) -> torch.Tensor:
    """Advantages of rewards [num_groups, G] within each group (row), over the samples whose reward
    was scored (`scored` [num_groups, G] bool; None: all): a sample whose reward failed gets 0 and
    takes no part in its group's baseline.

    - "mean": Â = R − mean_G(R), the paper's MiniRL baseline (no std division).
    - "std":  Â = (R − mean_G(R)) / (std_G(R) + eps), GRPO's group normalisation
      (unbiased std, as GRPO implementations compute it).
    - "loo":  Â_i = R_i − mean_{j≠i} R_j = n/(n−1) · (R_i − mean_G(R)), leave-one-out over the n scored.

    A group with fewer than two scored samples has no baseline to learn from: all 0 but for "mean"
    (where a lone sample's Â is 0 as well).
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [num_groups, G], got shape {tuple(rewards.shape)}")
    rewards = rewards.to(torch.float64 if rewards.dtype == torch.float64 else torch.float32)
    if scored is None:
        scored = torch.ones_like(rewards, dtype=torch.bool)
    elif scored.shape != rewards.shape:
        raise ValueError(f"scored {tuple(scored.shape)} must match rewards {tuple(rewards.shape)}")
    weight = scored.to(rewards.dtype)
    count = weight.sum(dim=1, keepdim=True)
    kept = torch.where(scored, rewards, torch.zeros_like(rewards))  # a failed reward's value never enters
    mean = kept.sum(dim=1, keepdim=True) / count.clamp(min=1)
    centered = torch.where(scored, kept - mean, torch.zeros_like(rewards))
    if mode == "mean":
        return centered
    several = count >= 2
    if mode == "std":
        std = ((centered**2).sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()
        return torch.where(several, centered / (std + eps), torch.zeros_like(centered))
    if mode == "loo":
        return torch.where(several, centered * (count / (count - 1).clamp(min=1)), torch.zeros_like(centered))
    raise ValueError(f"unknown advantage mode {mode!r}; expected 'mean', 'std' or 'loo'")
