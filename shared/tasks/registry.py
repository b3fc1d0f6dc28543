"""Rewards and tasks registered by name.

A reward is a plain callable `(completion_text, answer) -> float`, which may also take the problem's
dataset row by keyword (`shared.tasks.reward_contract`). `score` calls one and never raises: a
completion it cannot parse, an exception or a non-finite value scores 0 with a reason. A reward is
named by its registered name (`exact_match`, `math_verify`) or by a dotted path
`package.module:function`, imported where it runs. Rewards registered `inline` are pure and cheap
(they run where they are called); every other reward runs with a time limit in a reward process
(`shared.tasks.reward_runner`).
"""

from __future__ import annotations

import importlib
import logging
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from shared.rollouts.record import MAX_REWARD
from shared.tasks.reward_contract import Reward, Row

log = logging.getLogger(__name__)

RewardFn = Callable[..., float]  # (completion, answer, **row) -> float: shared.tasks.reward_contract
_REWARDS: dict[str, RewardFn] = {}
_INLINE: set[str] = set()
DOTTED = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


@dataclass(frozen=True)
class Example:
    """One prompt with its reference answer, and what else of its dataset row a reward may ask for."""

    prompt: str
    """The text the model is prompted with (before the chat template)."""
    answer: str
    """The reference answer its reward scores a completion against."""
    columns: dict[str, Any] = field(default_factory=dict)
    """The row's other columns (JSON values), for a reward that takes them by name."""
    row_prompt: str | None = None
    """The prompt as the row gives it, when a template made `prompt` of it (None: `prompt` itself)."""

    def row(self) -> Row:
        """What a reward may ask for of this example's row."""
        return Row(self.prompt if self.row_prompt is None else self.row_prompt, self.columns)


def score(fn: RewardFn, completion: str, answer: str, row: Mapping[str, Any] | None = None) -> tuple[float, str]:
    """(reward, reason): reason is '' for a good value, else why the call failed (value 0): it
    raised, returned no finite number, or one past what the loss holds (|r| > MAX_REWARD: 1e39 is
    a finite float64 and an infinite float32). `row`: the keyword arguments it takes (`Reward.keywords`)."""
    try:
        value = float(fn(completion, answer, **(row or {})))
    except Exception as exc:  # noqa: BLE001 - a reward must never take a replica down, whatever it raises
        return 0.0, f"error:{type(exc).__name__}"
    if not math.isfinite(value):
        return 0.0, "nonfinite"
    if abs(value) > MAX_REWARD:
        return 0.0, "out_of_range"
    return value, ""


def register_reward(name: str, inline: bool = False) -> Callable[[RewardFn], RewardFn]:
    """Decorator: register `fn` (a `RewardFunction`) as the reward a recipe names `name`; the
    registered callable scores its failures 0.

    `inline`: pure and cheap, safe to run on the caller's thread without a time limit; every other
    reward runs in a reward process."""

    def decorate(fn: RewardFn) -> RewardFn:
        def safe(completion: str, answer: str, **row: Any) -> float:
            value, reason = score(fn, completion, answer, row)
            if reason:
                log.warning("reward=%s failed reason=%s", name, reason)
            return value

        safe.__name__ = fn.__name__
        safe.__doc__ = fn.__doc__
        safe.raw = fn  # type: ignore[attr-defined]
        _REWARDS[name] = safe
        if inline:
            _INLINE.add(name)
        return safe

    return decorate


def is_inline(name: str) -> bool:
    """Whether `name` was registered `inline`: called on the caller's thread, without a reward process."""
    return name in _INLINE


def resolve_reward(name: str) -> RewardFn:
    """The raw reward callable for a registered name or a `module:function` path."""
    if name in _REWARDS:
        return _REWARDS[name].raw  # type: ignore[attr-defined]
    if not DOTTED.match(name):
        raise KeyError(f"no reward named {name!r}; registered: {sorted(_REWARDS)}, or give module:function")
    return import_plugin(name, "reward")


def load_reward(name: str) -> Reward:
    """The reward `name` with what of the row it takes, read from its signature (KeyError when unknown)."""
    return Reward.of(resolve_reward(name))


def import_plugin(name: str, kind: str) -> Callable:
    """The callable a `module:attribute` path names; KeyError naming why it cannot be had."""
    module, attr = name.split(":")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise KeyError(f"{kind} {name!r} cannot be imported: {exc}") from None
    if not callable(fn):
        raise KeyError(f"{kind} {name!r} is not callable")
    return fn


def get_reward(name: str) -> RewardFn:
    """A registered reward, wrapped so that it never raises (0 on failure)."""
    try:
        return _REWARDS[name]
    except KeyError:
        raise KeyError(f"no reward named {name!r}; registered: {sorted(_REWARDS)}") from None


def reward_names() -> list[str]:
    """The registered rewards' names."""
    return sorted(_REWARDS)
