"""Pure tensor math of steadyrl: advantages, importance weights, clipping, KL, the loss.

Imports torch only — no I/O, no services. Notation follows the paper (arXiv 2512.01374).
"""

from shared.core.advantages import group_advantages
from shared.core.corrections import (
    clip_mask,
    geometric_mask,
    icepop_mask,
    sequence_mis_mask,
    sequence_tis_weight,
    token_tis_weight,
)
from shared.core.diagnostics import (
    entropy_from_logits,
    first_order_error,
    masked_max,
    masked_mean,
    mismatch_kl,
    routing_agreement,
)
from shared.core.loss import LossConfig, policy_loss

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
