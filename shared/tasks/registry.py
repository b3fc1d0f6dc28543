"""Rewards and tasks registered by name.

A reward is a plain callable `(completion_text, answer) -> float`; it never raises (a completion
it cannot parse scores 0). A task turns a seed/split into prompt/answer examples.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

RewardFn = Callable[[str, str], float]
_REWARDS: dict[str, RewardFn] = {}


@dataclass(frozen=True)
class Example:
    """One prompt with its reference answer."""

    prompt: str
    answer: str
    meta: dict[str, str] = field(default_factory=dict)


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: register `fn` as the reward called `name`; its failures score 0."""

    def decorate(fn: RewardFn) -> RewardFn:
        def safe(completion: str, answer: str) -> float:
            try:
                value = float(fn(completion, answer))
            except Exception as exc:  # a reward must never take a replica down
                log.warning("reward=%s error=%s", name, type(exc).__name__)
                return 0.0
            return value if value == value and abs(value) != float("inf") else 0.0

        safe.__name__ = fn.__name__
        safe.__doc__ = fn.__doc__
        _REWARDS[name] = safe
        return safe

    return decorate


def get_reward(name: str) -> RewardFn:
    try:
        return _REWARDS[name]
    except KeyError:
        raise KeyError(f"no reward named {name!r}; registered: {sorted(_REWARDS)}") from None


def reward_names() -> list[str]:
    return sorted(_REWARDS)
