"""Group advantages Â(x, y) for G responses per prompt (paper Eq. 7, Appendix A)."""

from __future__ import annotations

from typing import Literal

import torch

AdvantageMode = Literal["mean", "std", "loo"]


def group_advantages(rewards: torch.Tensor, mode: AdvantageMode = "mean", eps: float = 1e-6) -> torch.Tensor:
    """Advantages of rewards [num_groups, G] within each group (row).

    - "mean": Â = R − mean_G(R), the paper's MiniRL baseline (no std division).
    - "std":  Â = (R − mean_G(R)) / (std_G(R) + eps), GRPO's group normalisation
      (unbiased std, as GRPO implementations compute it).
    - "loo":  Â_i = R_i − mean_{j≠i} R_j = G/(G−1) · (R_i − mean_G(R)), leave-one-out.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [num_groups, G], got shape {tuple(rewards.shape)}")
    group_size = rewards.shape[1]
    rewards = rewards.to(torch.float64 if rewards.dtype == torch.float64 else torch.float32)
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    if mode == "mean":
        return centered
    if mode == "std":
        if group_size < 2:
            return torch.zeros_like(centered)
        return centered / (rewards.std(dim=1, keepdim=True) + eps)
    if mode == "loo":
        if group_size < 2:
            return torch.zeros_like(centered)
        return centered * (group_size / (group_size - 1))
    raise ValueError(f"unknown advantage mode {mode!r}; expected 'mean', 'std' or 'loo'")
