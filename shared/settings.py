"""Settings fields several models share, declared once: the shape of a global step, which the
trainer, the orchestrator and a recipe's [run] must agree on."""

from __future__ import annotations

from pydantic import BaseModel, Field


class StepShape(BaseModel):
    batch_prompts: int = Field(8, ge=1)
    """B: prompts (complete groups of G) per global step."""
    group_size: int = Field(8, ge=1)
    """G: samples per prompt."""
    max_staleness: int = Field(1, ge=0)
    """Versions a rollout may lag the trainer when trained: admission keeps at most
    (max_staleness + 1) × B prompts outstanding, and the trainer drops older groups (0 = synchronous)."""
