"""Sampling parameters of one request, checked to finite, sane ranges wherever they enter: a task,
the OpenAI-compatible endpoint, a gRPC Generate, a recipe. No torch here, so settings can use the
same bounds without importing an engine.

A temperature above 0 but below `MIN_TEMPERATURE` is refused, not clamped: logits divided by
1e-40 overflow float32 and the sampling of that row fails (vLLM clamps such values to 0.01 with a
warning, which changes the distribution a rollout's logprobs claim it came from).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MIN_TEMPERATURE = 0.01
MAX_TEMPERATURE = 100.0
MAX_SEED = 2**62  # seed + a sample's index must stay within torch's and vLLM's 64-bit seeds
MAX_NEW_TOKENS = 1 << 20
MAX_SCORE_TOP_K = 20  # the most top-k logprobs a teacher serves per position (vLLM's default max_logprobs)


def check_temperature(value: float) -> float:
    """`value` if it is 0 (greedy) or lies in [MIN_TEMPERATURE, MAX_TEMPERATURE], else ValueError."""
    if not _is_number(value) or not (value == 0 or MIN_TEMPERATURE <= value <= MAX_TEMPERATURE):
        raise ValueError(
            f"temperature must be 0 (greedy) or lie in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], got {value!r}"
        )
    return float(value)


def check_top_p(value: float) -> float:
    if not _is_number(value) or not 0 < value <= 1:
        raise ValueError(f"top_p must lie in (0, 1], got {value!r}")
    return float(value)


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check_int(name: str, value, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer in [{low}, {high}], got {value!r}")
    return value


@dataclass(frozen=True)
class Sampling:
    """Sampling parameters of one request (SamplingParams on the wire)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # <= 0: off
    max_new_tokens: int = 16
    seed: int = 0  # 0: unseeded
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # run to max_new_tokens past the model's end-of-sequence token

    def __post_init__(self) -> None:
        check_temperature(self.temperature)
        check_top_p(self.top_p)
        _check_int("top_k", self.top_k, -1, 1 << 31)
        _check_int("max_new_tokens", self.max_new_tokens, 1, MAX_NEW_TOKENS)
        _check_int("seed", self.seed, 0, MAX_SEED)
        for token in self.stop_token_ids:
            _check_int("a stop token id", token, 0, 1 << 31)

    @classmethod
    def from_proto(cls, params) -> Sampling:
        """From a steadyrl.v1.SamplingParams; proto3 zeros mean the defaults (top_p 0 → 1)."""
        return cls(
            temperature=params.temperature,
            top_p=params.top_p or 1.0,
            top_k=params.top_k,
            max_new_tokens=params.max_new_tokens or 16,
            seed=params.seed,
            stop_token_ids=tuple(params.stop_token_ids),
            ignore_eos=params.ignore_eos,
        )
