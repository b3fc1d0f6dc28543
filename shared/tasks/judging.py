"""Model-judged rewards: the reward names a judge pool scores, the judge prompt a template fills,
and the grammar that turns a judge's verdict text into a reward. Pure: the pool calls live in
services/inference/judge.py.

The completion sits between the template's markers, its markers and anchors taken out, so it can
neither close its own block nor write a verdict the judge might copy; the verdict is what follows
the anchor (`VERDICT:`), once, on the judge's last line, read strictly (a number or fraction,
yes/no, or a label) and checked in float32 against the template's range.

Details: docs/guides/pools.md"""

from __future__ import annotations

import math
import re
import string
import unicodedata

import numpy as np

MODEL_REWARD = re.compile(r"^(judge|reward_model):([a-z0-9_]{1,64})$")
PLACEHOLDERS = frozenset({"prompt", "response", "answer"})
# ASCII digits only (a verdict of "١٠" or "１０" is not a number here), no bare trailing point
NUMBER = re.compile(r"[-+]?(?:[0-9]+(?:\.[0-9]+)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?", re.ASCII)
FRACTION = re.compile(rf"(?P<num>{NUMBER.pattern})[ \t]*/[ \t]*(?P<den>{NUMBER.pattern})", re.ASCII)
YES = frozenset({"yes", "y", "true", "correct"})
NO = frozenset({"no", "n", "false", "incorrect", "wrong"})
DEFAULT_RANGE = (-1e4, 1e4)


class VerdictError(ValueError):
    """A verdict that no rule can read: `reason` says why (the sample's reward failed with it)."""

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


ANGLES = {"<": r"(?:<|&lt;?|&#0*60;?|&#x0*3c;?)", ">": r"(?:>|&gt;?|&#0*62;?|&#x0*3e;?)"}  # and as HTML writes them


def _loose(needle: str) -> str:
    """A pattern of `needle` with any whitespace between its characters, angle brackets also as HTML
    entities (what a judge may still read as the marker)."""
    return r"\s*".join(ANGLES.get(c, re.escape(c)) for c in needle)


def strip_all(text: str, needles: list[str]) -> str:
    """`text` in Unicode's compatibility form (full-width and other look-alikes folded, zero-width and
    direction marks dropped) with every case-insensitive occurrence of each needle removed, spaced
    out or written as HTML, again until none is left (taking one out may join the text around it
    into another)."""
    text = "".join(c for c in unicodedata.normalize("NFKC", text) if unicodedata.category(c) != "Cf")
    pattern = re.compile("|".join(_loose(n) for n in needles if n), re.IGNORECASE) if any(needles) else None
    while pattern is not None:
        stripped = pattern.sub("", text)
        if stripped == text:
            return text
        text = stripped
    return text


def delimit(response: str, markers: tuple[str, str], anchor: str, max_chars: int) -> str:
    """The completion as the judge reads it: cut to `max_chars`, its markers and anchors taken out,
    between the two markers."""
    return markers[0] + strip_all(response[:max_chars], [*markers, anchor]) + markers[1]


def render(
    template: str,
    prompt: str,
    response: str,
    answer: str,
    markers: tuple[str, str] = ("", ""),
    anchor: str = "",
    max_chars: int = 1 << 30,
) -> str:
    """The judge's input for one completion (delimited by `markers`, see `delimit`)."""
    return template.format(prompt=prompt, response=delimit(response, markers, anchor, max_chars), answer=answer)


def verdict_text(text: str, anchor: str) -> str:
    """What follows the anchor: it must appear exactly once (case-insensitive), on the judge's last
    non-empty line. VerdictError `verdict:unparsed` or `verdict:ambiguous` (an echo of another's)."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise VerdictError("verdict:empty")
    if not anchor:
        return lines[-1].strip()
    count = text.lower().count(anchor.lower())
    if count > 1:
        raise VerdictError("verdict:ambiguous")
    at = lines[-1].lower().find(anchor.lower())
    if count == 0 or at < 0:
        raise VerdictError("verdict:unparsed")
    return lines[-1][at + len(anchor) :].strip()


def read_number(word: str) -> float:
    """A number or a fraction `a/b` (b > 0), the whole of `word`; VerdictError else."""
    if NUMBER.fullmatch(word):
        return float(word)
    fraction = FRACTION.fullmatch(word)
    if fraction and float(fraction["den"]) > 0:
        return float(fraction["num"]) / float(fraction["den"])
    raise VerdictError("verdict:unparsed")


def pattern_verdict(text: str, pattern: str) -> str:
    """The `verdict` group of `pattern`, which the judge's last non-empty line must match whole (no
    other line may: `verdict:ambiguous`, an echo); VerdictError `verdict:unparsed` else."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        raise VerdictError("verdict:empty")
    compiled = re.compile(pattern)
    match = compiled.fullmatch(lines[-1])
    if match is None:
        raise VerdictError("verdict:unparsed")
    if any(compiled.fullmatch(line) for line in lines[:-1]):
        raise VerdictError("verdict:ambiguous")
    return match["verdict"]


def parse_verdict(text: str, rule: str, labels: dict[str, float], anchor: str = "VERDICT:", pattern: str = "") -> float:
    """The reward a judge's text gives under `rule` (number | yes_no | label), read strictly from
    what follows its anchor, or from `pattern`'s `verdict` group when a template gives one (one
    trailing period allowed); VerdictError when it cannot be read."""
    found = pattern_verdict(text, pattern) if pattern else verdict_text(text, anchor)
    word = found.removesuffix(".").strip()
    if rule == "number":
        return read_number(word)
    lowered = word.lower()
    if rule == "yes_no":
        if lowered in YES:
            return 1.0
        if lowered in NO:
            return 0.0
        raise VerdictError("verdict:unparsed")
    if rule == "label":
        if lowered not in labels:
            raise VerdictError("verdict:unknown_label")
        return float(labels[lowered])
    raise ValueError(f"unknown verdict rule {rule!r}; expected number, yes_no or label")


def in_range(value: float, bounds: tuple[float, float]) -> bool:
    """Whether `value`, as the float32 the loss will hold, is finite and within `bounds`."""
    as_loss = float(np.float32(value)) if math.isfinite(value) and abs(value) < 3.4e38 else math.inf
    return math.isfinite(as_loss) and bounds[0] <= as_loss <= bounds[1]
