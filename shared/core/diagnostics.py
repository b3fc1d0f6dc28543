"""Diagnostics the paper watches for collapse: mismatch KL, entropy, first-order validity,
routing agreement. All reductions are over valid tokens only (`mask`, bool [B, T])."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from shared.core.stats import StepStats
    from shared.core.terms import Parts, TokenTerms

# exp() of a larger sequence log-ratio overflows float64; the first-order error saturates here.
MAX_SEQUENCE_LOG_RATIO = 50.0


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of values over mask; 0 when nothing is valid."""
    count = mask.sum()
    total = torch.where(mask, values, torch.zeros_like(values)).sum()
    return total / count.clamp(min=1)


def masked_max(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Max of values over mask; 0 when nothing is valid."""
    if not bool(mask.any()):
        return torch.zeros((), dtype=values.dtype, device=values.device)
    return values[mask].max()


def mismatch_kl_terms(
    inference_logprobs: torch.Tensor, train_logprobs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token terms of the training–inference KL estimators (see `mismatch_kl`), [B, T] each."""
    log_ratio = train_logprobs - inference_logprobs  # log π/μ
    return -log_ratio, torch.expm1(log_ratio) - log_ratio


def mismatch_kl(
    inference_logprobs: torch.Tensor, train_logprobs: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Training–inference KL D_KL(μ_old ‖ π_old) estimated on μ-sampled tokens.

    k1 = E_μ[log μ − log π];  k3 = E_μ[(π/μ − 1) − log(π/μ)]  (non-negative, lower variance).
    """
    k1, k3 = mismatch_kl_terms(inference_logprobs, train_logprobs)
    return masked_mean(k1, mask), masked_mean(k3, mask)


def first_order_error(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence |Π_t(1+δ_t) − (1+Σ_t δ_t)| with δ_t = ρ_t − 1, ρ_t = exp(log_ratio_t). [B, T] → [B].

    The product is taken in log space (exp Σ_t log ρ_t), in float64; the sequence log-ratio is
    capped at MAX_SEQUENCE_LOG_RATIO so the diagnostic stays finite when the surrogate is far off.
    """
    log_ratio = torch.where(mask, log_ratio.double(), torch.zeros_like(log_ratio, dtype=torch.float64))
    product = torch.exp(torch.clamp(log_ratio.sum(dim=-1), max=MAX_SEQUENCE_LOG_RATIO))
    first_order = 1.0 + torch.expm1(log_ratio).sum(dim=-1)
    return (product - first_order).abs()


def entropy_from_logits(logits: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Token entropy −Σ_w p(w) log p(w) of logits [B, T, V] → [B, T] (mean over mask if given)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    entropy = -(logp.exp() * logp).sum(dim=-1)
    if mask is None:
        return entropy
    return masked_mean(entropy, mask)


def routing_agreement(
    experts_a: torch.Tensor, experts_b: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Share of (token, layer) top-k expert *sets* equal between two traces [..., L, K].

    `mask` selects tokens (shape = the leading dims); every layer of a selected token counts.
    """
    if experts_a.shape != experts_b.shape:
        raise ValueError(f"trace shapes differ: {tuple(experts_a.shape)} vs {tuple(experts_b.shape)}")
    same = (experts_a.sort(dim=-1).values == experts_b.sort(dim=-1).values).all(dim=-1)
    if mask is None:
        return same.double().mean()
    per_token = mask.unsqueeze(-1).expand_as(same)
    return masked_mean(same.double(), per_token)


def loss_diagnostics(
    t: TokenTerms,
    parts: Parts,
    loss_mask: torch.Tensor,
    stats: StepStats | None = None,
    buckets: tuple[torch.Tensor, list[int]] | None = None,
) -> dict[str, torch.Tensor]:
    """A loss call's scalar diagnostics (means over its valid tokens), and the same as token sums
    into `stats` (whole-step statistics), per staleness bucket with `buckets`."""
    mask = t.mask
    dtype = parts.weight.dtype
    k1, k3 = mismatch_kl_terms(t.inference, t.trainer.detach() if t.bypass else t.old)
    sequences = mask.any(dim=-1)
    per_token = {
        "is_weight_mean": parts.weight,
        "is_truncated_frac": parts.truncated.to(dtype),
        "clip_frac": (~parts.clip_keep).to(dtype),
        "rejected_frac": (~parts.keep).to(dtype),
        "importance_ratio_mean": t.ratio,
        "mismatch_kl_k1": k1,
        "mismatch_kl_k3": k3,
        "advantage_mean": t.advantages,
    }
    first_order = first_order_error(t.log_ratio, mask)
    metrics = {name: masked_mean(values, mask) for name, values in per_token.items()}
    metrics.update(
        is_weight_max=masked_max(parts.weight, mask),
        first_order_error=masked_mean(first_order, sequences),
        valid_tokens=mask.sum().to(dtype),
        nonfinite_tokens=(loss_mask.bool() & ~mask).sum().to(dtype),
    )
    if stats is not None:
        for name, values in per_token.items():
            stats.add_mean(name, values, mask)
        stats.add_max("is_weight_max", parts.weight, mask)
        stats.add_mean("first_order_error", first_order, sequences)
        stats.add_total("valid_tokens", mask.sum())
        stats.add_total("nonfinite_tokens", (loss_mask.bool() & ~mask).sum())
        if buckets is not None:
            bucket_of, values = buckets
            for b in values:
                where = mask & (bucket_of == b)
                stats.add_mean(f"mismatch_kl_k3_s{b}", k3, where)
                stats.add_mean(f"is_weight_mean_s{b}", parts.weight, where)
    return metrics
