"""The reward function contract: what steadyrl calls a reward with, and the dataset row it may ask for.

A reward scores a completion against its problem's answer, `reward(completion, answer) -> float`, and
may also ask for the problem's dataset row by keyword (the prompt, the other columns: `RewardFunction`),
as TRL's reward functions get the prompt and every column and verl's get `extra_info`. What it takes is
read from its signature once, when it is loaded (`Reward.of`); the row travels with a task only when the
reward takes it, JSON values only and bounded (`Row`), checked where it enters.
Guide: docs/guides/model-data-reward.md.
"""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

MAX_COLUMNS_BYTES = 64 << 10
"""A row's extra columns, as JSON: a dataset row past it is refused when the data is loaded (a reward
gets its row with every call, through Redis and the reward process's pipe)."""
MAX_ROW_BYTES = 2 << 20
"""A task's whole row (its prompt and columns) as JSON; a task carrying more is refused by the replica."""
MAX_DEPTH = 32
"""Nesting of lists and dicts in a column's value."""
RESERVED = frozenset({"completion", "answer", "prompt"})
"""Names a column cannot pass under (they are the reward's own arguments): such a column is left out."""
JSON_TYPES = "str, int, float, bool, None, and lists and dicts of those"
"""The values a column may hold (floats finite, dict keys text)."""


class RewardFunction(Protocol):
    """A reward: `completion` (the model's text, special tokens removed) against `answer` (the row's
    reference answer), as a finite number.

    Keyword arguments beyond the two are optional: a parameter named `prompt` gets the row's prompt,
    one named after a column gets that column, `**kwargs` gets all of them. Give each a default: a task
    without the row (the dry call before the start, a task queued before the reward asked for it, a row
    of another source without that column) calls the reward without it.

    A reward that raises, hangs or returns no finite number scores a failed call (value 0 with a reason,
    left out of the loss), never a crash: see `shared.tasks.reward_runner`."""

    def __call__(self, completion: str, answer: str, /, **row: Any) -> float: ...


@dataclass(frozen=True)
class Row:
    """What a reward may get of its problem's dataset row: the prompt (None: not carried) and the other
    columns by name, all JSON values."""

    prompt: str | None = None
    """The prompt as the row gives it, before any template and the chat template (None: not carried)."""
    columns: Mapping[str, Any] = field(default_factory=dict)
    """The row's other columns by name (never one named completion, answer or prompt)."""

    def keywords(self) -> dict[str, Any]:
        """The keyword arguments this row makes: `prompt` when carried, then each column."""
        return {**({"prompt": self.prompt} if self.prompt is not None else {}), **self.columns}

    def to_object(self) -> dict[str, Any]:
        """The row as JSON carries it: {"prompt": ..., "columns": {...}} (no prompt when not carried)."""
        return {"columns": dict(self.columns), **({"prompt": self.prompt} if self.prompt is not None else {})}

    def to_json(self) -> str:
        """The row as a task carries it (`to_object`, as compact JSON)."""
        return json.dumps(self.to_object(), ensure_ascii=False, allow_nan=False, separators=(",", ":"))

    def checked(self, where: str) -> Row:
        """This row, or ValueError naming `where` when a column is no JSON value, the columns pass
        MAX_COLUMNS_BYTES or the whole row MAX_ROW_BYTES."""
        check_columns(self.columns, where)
        size = len(self.to_json().encode())
        if size > MAX_ROW_BYTES:
            raise ValueError(
                f"{where}: its prompt and columns are {size} bytes as JSON, past the {MAX_ROW_BYTES} limit"
            )
        return self

    @classmethod
    def from_object(cls, value: Any, where: str = "the task's row") -> Row:
        """A row from its decoded JSON object (as `to_object` makes it), checked like any untrusted input."""
        if not isinstance(value, dict) or not set(value) <= {"prompt", "columns"}:
            raise ValueError(f"{where}: an object of 'prompt' and 'columns' expected")
        prompt = value.get("prompt")
        columns = value.get("columns", {})
        if prompt is not None and not isinstance(prompt, str):
            raise ValueError(f"{where}: its prompt is not text")
        if not isinstance(columns, dict):
            raise ValueError(f"{where}: its columns are not an object")
        return cls(prompt, columns).checked(where)

    @classmethod
    def from_json(cls, text: str, where: str = "the task's row") -> Row | None:
        """The row a task carries (None for none: a reward that does not ask, or an older task); a
        forged one (past MAX_ROW_BYTES, no JSON, deeper than MAX_DEPTH, other types) is a ValueError."""
        if not text:
            return None
        if len(text) > MAX_ROW_BYTES:  # characters: a lower bound of its bytes, checked before parsing
            raise ValueError(f"{where}: {len(text)} characters, past the {MAX_ROW_BYTES}-byte limit")
        try:
            value = json.loads(text, parse_constant=_no_constant)
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"{where}: not JSON ({str(exc)[:200]})") from None
        return cls.from_object(value, where)


def check_columns(columns: Mapping[str, Any], where: str) -> None:
    """ValueError naming `where` and the column when a value is not JSON (`JSON_TYPES`, finite numbers,
    text keys, at most MAX_DEPTH deep) or the columns pass MAX_COLUMNS_BYTES as JSON."""
    for name, value in columns.items():
        if not isinstance(name, str) or name in RESERVED:
            raise ValueError(
                f"{where}: column {name!r} cannot be passed to a reward (names {sorted(RESERVED)} are taken)"
            )
        problem = _not_json(value, 0)
        if problem:
            raise ValueError(f"{where}: column {name!r} {problem}; a reward gets JSON values only ({JSON_TYPES})")
    size = len(json.dumps(columns, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode())
    if size > MAX_COLUMNS_BYTES:
        raise ValueError(
            f"{where}: its extra columns are {size} bytes as JSON, past the {MAX_COLUMNS_BYTES}-byte limit "
            "(a reward that asks for the row gets them with every call): drop or shorten the large ones"
        )


def _not_json(value: Any, depth: int) -> str:
    """Why `value` is no JSON value ('' when it is one)."""
    if depth > MAX_DEPTH:
        return f"nests deeper than {MAX_DEPTH}"
    if value is None or isinstance(value, bool):
        return ""
    if isinstance(value, int):  # past this JSON's text of it hits Python's digit limit
        return "" if value.bit_length() <= 1024 else "holds an integer past 1024 bits"
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return "holds text that is not valid Unicode (a lone surrogate)"
        return ""
    if isinstance(value, float):
        return "" if math.isfinite(value) else f"holds {value}, not a finite number"
    if isinstance(value, list):
        return next((p for p in (_not_json(v, depth + 1) for v in value) if p), "")
    if isinstance(value, dict):
        if not all(isinstance(k, str) and not _not_json(k, depth) for k in value):
            return "holds an object with a key that is not valid text"
        return next((p for p in (_not_json(v, depth + 1) for v in value.values()) if p), "")
    return f"holds a {type(value).__name__}"


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


@dataclass(frozen=True)
class Reward:
    """A reward function and what of the row it takes beyond (completion, answer), read once from its
    signature: the names of its keyword parameters, or None when it takes `**kwargs` (everything)."""

    fn: Callable[..., float]
    """The reward function itself (a `RewardFunction`)."""
    takes: frozenset[str] | None = frozenset()
    """The names of its keyword parameters beyond (completion, answer); None: `**kwargs`, everything."""

    @classmethod
    def of(cls, fn: Callable[..., float]) -> Reward:
        """`fn` with what its signature takes (a callable without one: the two-argument form)."""
        try:
            parameters = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError):
            return cls(fn)
        if any(p.kind is p.VAR_KEYWORD for p in parameters):
            return cls(fn, None)
        positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:2]
        return cls(
            fn,
            frozenset(
                p.name
                for p in parameters
                if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p not in positional
            ),
        )

    @property
    def takes_row(self) -> bool:
        """Whether it takes anything of the row (then tasks carry it)."""
        return self.takes is None or bool(self.takes)

    def select(self, row: Row | None) -> Row | None:
        """What of `row` it takes (None when nothing): so a task carries no column nobody reads."""
        if row is None or not self.takes_row:
            return None
        if self.takes is None:
            return row
        prompt = row.prompt if "prompt" in self.takes else None
        columns = {name: value for name, value in row.columns.items() if name in self.takes}
        return Row(prompt, columns) if prompt is not None or columns else None

    def keywords(self, row: Row | None) -> dict[str, Any]:
        """The keyword arguments of a call with `row`: {} for the two-argument form or no row."""
        selected = self.select(row)
        return selected.keywords() if selected is not None else {}
