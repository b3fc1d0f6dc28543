"""Sampled-eval statistics: pass@k (the unbiased estimator of Chen et al., 2021) and mean@k. Pure."""

from __future__ import annotations

import math


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n samples, c of
    them correct, is correct: 1 − C(n − c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def sampled_scores(correct_per_prompt: list[tuple[int, int]], k: int) -> dict[str, float]:
    """pass@k and mean@k over prompts, each given as (samples n, correct c)."""
    if not correct_per_prompt:
        raise ValueError("no prompts")
    passes = [pass_at_k(n, c, k) for n, c in correct_per_prompt]
    means = [c / n for n, c in correct_per_prompt]
    return {"pass_at_k": sum(passes) / len(passes), "mean_at_k": sum(means) / len(means)}
