"""Rewards that take the dataset row (`tests.rewards_with_row:<name>`), loaded by dotted path as a user's are."""


def difficulty(completion: str, answer: str, *, prompt: str = "", difficulty: int = 0) -> float:
    """Exact match × the row's difficulty, plus the prompt's length / 1000: each argument shows in the value."""
    return float(completion == answer) * difficulty + len(prompt) / 1000


def everything(completion: str, answer: str, **row) -> float:
    """The number of keyword arguments it got, and the sum of the numeric ones: what **row received."""
    return len(row) + sum(v for v in row.values() if isinstance(v, int | float) and not isinstance(v, bool))


def needs_prompt(completion: str, answer: str, prompt: str) -> float:
    """A row argument without a default: refused before a run (a task without the row could not call it)."""
    return float(bool(prompt))


def positional_prompt(completion: str, answer: str, prompt: str = "", /) -> float:
    return float(bool(prompt))
