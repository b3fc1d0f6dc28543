"""Tasks with verifiable rewards: synthetic addition for the tiny model, math from local files."""

from shared.tasks.arith import ArithTask, exact_match
from shared.tasks.math_task import MathTask, math_verify_reward
from shared.tasks.registry import Example, get_reward, register_reward, reward_names

__all__ = [
    "ArithTask",
    "Example",
    "MathTask",
    "exact_match",
    "get_reward",
    "math_verify_reward",
    "register_reward",
    "reward_names",
]
