"""Reward shaping a replica applies to a training rollout before it is published: DAPO's soft
overlong punishment (arXiv 2503.14476, section 3.4), a penalty that grows linearly over the last
`buffer` tokens of the completion budget."""

from __future__ import annotations

import math


def overlong_penalty(length: int, budget: int, buffer: int, penalty: float) -> float:
    """The (non-positive) reward added to a completion of `length` tokens under a `budget` of
    max_new_tokens: 0 up to budget − buffer tokens, then −penalty · (length − (budget − buffer)) /
    buffer, −penalty at the budget (and past it). buffer 0: 0."""
    if buffer <= 0:
        return 0.0
    if not (0 < buffer < budget and math.isfinite(penalty) and penalty >= 0):
        raise ValueError(
            f"overlong shaping needs 0 < buffer < budget and a finite penalty >= 0, got {buffer}, {budget}, {penalty}"
        )
    over = min(max(length - (budget - buffer), 0), buffer)
    return -penalty * over / buffer
