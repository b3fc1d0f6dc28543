"""Reward plug-ins the tests load by dotted path (`tests.rewards:<name>`), as a user's would be."""

import random
import time


def hang(completion: str, answer: str) -> float:
    """A reward that never returns."""
    while True:
        time.sleep(1)


def explode(completion: str, answer: str) -> float:
    raise RuntimeError("a reward bug")


def length(completion: str, answer: str) -> float:
    """The completion's length in characters (a plug-in that works)."""
    return float(len(completion))


def one_arg(completion: str) -> float:
    """A plug-in with the wrong signature."""
    return 1.0


def hang_after_dry_call(completion: str, answer: str) -> float:
    """Passes the dry call a recipe's reward gets before start ("0", "0"), then never returns."""
    return 1.0 if completion == "0" else hang(completion, answer)


def explode_after_dry_call(completion: str, answer: str) -> float:
    """Passes the dry call, then raises on every real completion."""
    return 1.0 if completion == "0" else explode(completion, answer)


_FLAKY = random.Random(5)  # seeded: one reward process fails the same calls on every run


def flaky_exact_match(completion: str, answer: str) -> float:
    """Exact match that raises on 5 % of its calls (each call draws from a seeded stream: a retry of
    the same completion draws again)."""
    if _FLAKY.random() < 0.05:
        raise ConnectionError("the reward's backend dropped the call")
    return float(completion.strip() == answer.strip())


def nan_sometimes(completion: str, answer: str) -> float:
    """Exact match that returns NaN on 5 % of its calls (seeded, as flaky_exact_match)."""
    if _FLAKY.random() < 0.05:
        return float("nan")
    return float(completion.strip() == answer.strip())


def huge(completion: str, answer: str) -> float:
    """A number no loss can hold in float32 (finite as a float64)."""
    return 1e39
