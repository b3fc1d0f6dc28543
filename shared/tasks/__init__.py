"""Tasks with verifiable rewards: synthetic addition for the tiny model, math from local files."""

from shared.tasks.arith import ArithTask, exact_match
from shared.tasks.math_task import MathTask, math_verify_reward
from shared.tasks.registry import (
    Example,
    get_reward,
    is_inline,
    register_reward,
    resolve_reward,
    reward_names,
    score,
)
from shared.tasks.reward_runner import RewardRunner, Score

__all__ = [
    "ArithTask",
    "Example",
    "MathTask",
    "RewardRunner",
    "Score",
    "exact_match",
    "get_reward",
    "is_inline",
    "math_verify_reward",
    "register_reward",
    "resolve_reward",
    "reward_names",
    "score",
]
