"""The learning rate of each global step: a linear warm-up, then constant, cosine or linear decay to
a floor at the run's last step. A pure function of the step, so a resumed trainer continues the
curve without a scheduler's state in its checkpoint (docs/concepts/objective.md#the-learning-rate-over-the-run)."""

from __future__ import annotations

import math
from typing import Literal, get_args

Schedule = Literal["constant", "cosine", "linear"]
SCHEDULES = get_args(Schedule)


def lr_factor(step: int, total: int, schedule: Schedule = "constant", warmup: int = 0, floor: float = 0.0) -> float:
    """The multiple of the base learning rate for global step `step` (0-based) of `total`:
    (step + 1) / warmup during the warm-up; then 1 (constant), or from 1 down to `floor` at the
    last step along a half cosine or a line."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown learning-rate schedule {schedule!r}; expected one of {SCHEDULES}")
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant" or total - warmup <= 1:
        return 1.0
    progress = min(1.0, (step - warmup) / (total - warmup - 1))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1 - progress
    return floor + (1 - floor) * shape
