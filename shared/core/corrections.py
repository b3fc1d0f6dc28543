"""Training–inference mismatch corrections: importance weights and rejection masks.

Shapes: log-ratio tensors are float [B, T]; `mask` is bool [B, T] (valid tokens). Sequence-level
functions reduce over T within each row and broadcast their result back to [B, T].
Every weight here is used under stop-gradient by the loss.
"""

from __future__ import annotations

import math

import torch


def token_tis_weight(log_ratio: torch.Tensor, cap: float) -> torch.Tensor:
    """Token-level truncated IS (TIS): w_t = min(exp(log_ratio_t), cap). Paper Eq. 7 with C = cap."""
    return torch.exp(torch.clamp(log_ratio, max=math.log(cap)))


def sequence_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log Π_t ρ_t over the valid tokens of each sequence: [B, T] → [B]."""
    return torch.where(mask, log_ratio, torch.zeros_like(log_ratio)).sum(dim=-1)


def sequence_tis_weight(log_ratio: torch.Tensor, mask: torch.Tensor, cap: float) -> torch.Tensor:
    """Sequence-level TIS: w(y) = min(Π_t ρ_t, cap), in log space, broadcast to [B, T]."""
    seq = sequence_log_ratio(log_ratio, mask)
    weight = torch.exp(torch.clamp(seq, max=math.log(cap)))
    return weight.unsqueeze(-1).expand_as(log_ratio)


def _bounds_mask(value: torch.Tensor, low: float | None, high: float | None) -> torch.Tensor:
    keep = torch.ones_like(value, dtype=torch.bool)
    if low is not None and low > 0:
        keep &= value >= math.log(low)
    if high is not None:
        keep &= value <= math.log(high)
    return keep


def sequence_mis_mask(
    log_ratio: torch.Tensor, mask: torch.Tensor, low: float | None, high: float | None
) -> torch.Tensor:
    """Sequence masked IS (MIS): keep a whole sequence iff low ≤ Π_t ρ_t ≤ high. Returns [B, T]."""
    keep = _bounds_mask(sequence_log_ratio(log_ratio, mask), low, high)
    return keep.unsqueeze(-1).expand_as(log_ratio)


def geometric_mask(log_ratio: torch.Tensor, mask: torch.Tensor, low: float | None, high: float | None) -> torch.Tensor:
    """Geometric-mean masking: keep a sequence iff low ≤ (Π_t ρ_t)^(1/|y|) ≤ high. Returns [B, T].

    A sequence without valid tokens has geometric mean 1 (kept; it contributes nothing anyway).
    """
    count = mask.sum(dim=-1).clamp(min=1)
    geo = sequence_log_ratio(log_ratio, mask) / count
    return _bounds_mask(geo, low, high).unsqueeze(-1).expand_as(log_ratio)


def icepop_mask(log_ratio: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """IcePop token masking: keep token t iff low ≤ ρ_t ≤ high (Ring-1T: [0.5, 5])."""
    return _bounds_mask(log_ratio, low, high)


def clip_mask(ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float) -> torch.Tensor:
    """MiniRL's token mask M_t (paper Eq. 7): 0 where Â>0 and r>1+ε_high or Â<0 and r<1−ε_low."""
    clipped_high = (advantages > 0) & (ratio > 1.0 + eps_high)
    clipped_low = (advantages < 0) & (ratio < 1.0 - eps_low)
    return ~(clipped_high | clipped_low)
