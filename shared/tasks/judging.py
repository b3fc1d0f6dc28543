"""Model-judged rewards: the reward names that a judge pool scores, the judge prompt a template
fills, and the rules that turn a judge's verdict text into a reward. Pure: the pool calls live in
services/inference/judge.py.

`judge:NAME` — a generative judge answers the filled template NAME; its verdict is parsed by the
template's rule (the last number, the last yes/no, or the last word looked up in a label map).
`reward_model:NAME` — a sequence-classification model returns a scalar for the filled template.

Details: docs/guides/pools.md"""

from __future__ import annotations

import math
import re
import string

MODEL_REWARD = re.compile(r"^(judge|reward_model):([a-z0-9_]{1,64})$")
PLACEHOLDERS = frozenset({"prompt", "response", "answer"})
NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
YES = frozenset({"yes", "y", "true", "correct"})
NO = frozenset({"no", "n", "false", "incorrect", "wrong"})


class VerdictError(ValueError):
    """A verdict that no rule can read: `reason` says why (the rollout scores 0 with it)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def model_reward(name: str) -> tuple[str, str] | None:
    """(kind, template) of a model-judged reward name (`judge:NAME`, `reward_model:NAME`), else None."""
    match = MODEL_REWARD.fullmatch(name)
    return (match.group(1), match.group(2)) if match else None


def is_model_reward(name: str) -> bool:
    """Whether `name` asks for a judge pool (ValueError for a malformed `judge:` / `reward_model:` name)."""
    if model_reward(name) is not None:
        return True
    if name.startswith(("judge:", "reward_model:")):
        raise ValueError(f"{name!r}: a model-judged reward is judge:NAME or reward_model:NAME, NAME lower-case a-z0-9_")
    return False


def check_template(prompt: str) -> str:
    """The template unchanged if it names only {prompt}, {response} and {answer} and names
    {response}; else ValueError saying which placeholder is wrong."""
    try:
        names = {field for _, field, _, _ in string.Formatter().parse(prompt) if field is not None}
    except ValueError as exc:
        raise ValueError(f"judge template {prompt[:80]!r}: {exc}") from None
    unknown = names - PLACEHOLDERS
    if unknown:
        raise ValueError(f"judge template names {sorted(unknown)}; it may name {sorted(PLACEHOLDERS)}")
    if "response" not in names:
        raise ValueError("a judge template must name {response}, the completion it judges")
    return prompt


def render(template: str, prompt: str, response: str, answer: str) -> str:
    """The judge's input for one completion."""
    return template.format(prompt=prompt, response=response, answer=answer)


def last_word(text: str) -> str:
    words = re.findall(r"[a-z0-9_]+", text.lower())
    if not words:
        raise VerdictError("verdict:empty")
    return words[-1]


def parse_verdict(text: str, rule: str, labels: dict[str, float]) -> float:
    """The reward a verdict gives under `rule` (number | yes_no | label); VerdictError when it
    cannot be read. A judge writes its reasoning first and its verdict last, so each rule reads the
    last number or word."""
    if rule == "number":
        numbers = NUMBER.findall(text)
        if not numbers:
            raise VerdictError("verdict:no_number")
        value = float(numbers[-1])
        if not math.isfinite(value):
            raise VerdictError("verdict:nonfinite")
        return value
    word = last_word(text)
    if rule == "yes_no":
        if word in YES:
            return 1.0
        if word in NO:
            return 0.0
        raise VerdictError("verdict:not_yes_no")
    if rule == "label":
        if word not in labels:
            raise VerdictError("verdict:unknown_label")
        return float(labels[word])
    raise ValueError(f"unknown verdict rule {rule!r}; expected number, yes_no or label")
