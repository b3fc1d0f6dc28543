"""Pure tensor math of steadyrl: advantages, importance weights, clipping, KL, the loss.

Imports torch only (each module when it is first used) — no I/O, no services. Notation follows the
paper (arXiv 2512.01374).
"""

from __future__ import annotations

import importlib

_HOMES = {
    "group_advantages": "advantages",
    **dict.fromkeys(
        (
            "clip_mask",
            "geometric_mask",
            "icepop_mask",
            "sequence_mis_mask",
            "sequence_tis_weight",
            "token_tis_weight",
        ),
        "corrections",
    ),
    **dict.fromkeys(
        ("entropy_from_logits", "first_order_error", "masked_max", "masked_mean", "mismatch_kl", "routing_agreement"),
        "diagnostics",
    ),
    "LossConfig": "loss_config",
    "policy_loss": "loss",
}


def __getattr__(name: str):
    """Each name from its module on first use: importing a torch-free part of the package (the loss
    configuration a recipe is typed with, the LR schedule) does not import torch."""
    if name in _HOMES:
        return getattr(importlib.import_module(f"shared.core.{_HOMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "LossConfig",
    "clip_mask",
    "entropy_from_logits",
    "first_order_error",
    "geometric_mask",
    "group_advantages",
    "icepop_mask",
    "masked_max",
    "masked_mean",
    "mismatch_kl",
    "policy_loss",
    "routing_agreement",
    "sequence_mis_mask",
    "sequence_tis_weight",
    "token_tis_weight",
]
