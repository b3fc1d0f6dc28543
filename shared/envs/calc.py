"""A calculator tool environment: the model may call `calc(EXPRESSION)` (integers, + - * and
parentheses) and reads `= RESULT` back; a turn without a call is its answer, rewarded 1 when it
holds the task's answer exactly (after stripping), else 0. Each step counts `tool_calls` and
`tool_errors`; the answer's step `tool_success`, 1 when a call computed the task's answer.

`MulTask` is the multi-turn task of the tiny-model kit: 2-digit multiplication, which the tiny
model cannot do in its head but can by calling the tool and copying its result."""

from __future__ import annotations

import ast
import hashlib
import operator
import random
import re
from dataclasses import dataclass
from typing import Any

from shared.envs.base import Environment, Message, Step, Tool
from shared.tasks.registry import Example

CALL = re.compile(r"calc\(([^()]*(?:\([^()]*\)[^()]*)*)\)")
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
LARGEST = 10**18  # results past it are refused (a model cannot make the tool compute without end)


def evaluate(expression: str) -> int:
    """The value of an integer expression of + - * and parentheses; ValueError for anything else."""

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            result = OPERATORS[type(node.op)](value(node.left), value(node.right))
            if abs(result) > LARGEST:
                raise ValueError("result too large")
            return result
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(f"not an integer expression: {ast.dump(node)[:60]}")

    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an expression: {exc.msg}") from None
    return value(tree.body)


class Calculator(Environment):
    tools = (
        Tool(
            "calc",
            "Evaluate an integer expression of + - * and parentheses.",
            {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
        ),
    )

    def __init__(self) -> None:
        self.answer = ""
        self.results = set()

    def reset(self, task: dict[str, Any]) -> list[Message]:
        self.answer = str(task["answer"]).strip()
        self.results = set()
        return [Message("user", str(task["prompt"]))]

    def step(self, model_turn: str) -> Step:
        call = CALL.search(model_turn)
        if call is None:
            return Step(
                [], float(model_turn.strip() == self.answer), True, {"tool_success": float(self.answer in self.results)}
            )
        try:
            value = str(evaluate(call.group(1)))
        except ValueError as exc:
            # the reason stays short: a few tokens of the trajectory's budget, whatever the model wrote
            reason = "too large" if "large" in str(exc) else "bad expression"
            return Step([Message("tool", f"error: {reason}")], 0.0, False, {"tool_calls": 1.0, "tool_errors": 1.0})
        self.results.add(value)
        return Step([Message("tool", f"= {value}")], 0.0, False, {"tool_calls": 1.0})


@dataclass(frozen=True)
class MulTask:
    """a * b with a, b in [low, high]; prompt "37*46=", answer "1702". Train and eval never share a
    problem (a hash of the problem picks its split)."""

    low: int = 10
    high: int = 99
    seed: int = 0
    name: str = "calc"

    def max_split_size(self, name: str) -> int:
        count = (self.high - self.low + 1) ** 2
        return count * (7 if name == "train" else 3) // 20

    def split(self, name: str, size: int) -> list[Example]:
        if name not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {name!r}")
        if size > self.max_split_size(name):
            raise ValueError(
                f"{size} {name} problems asked; [{self.low}, {self.high}]² allows {self.max_split_size(name)}"
            )
        rng = random.Random(f"{self.name}-{self.low}-{self.high}-{self.seed}-{name}")
        out: dict[tuple[int, int], Example] = {}
        while len(out) < size:
            a = rng.randint(self.low, self.high)
            b = rng.randint(self.low, self.high)
            digest = hashlib.blake2b(f"{self.seed}:{a}*{b}".encode(), digest_size=2).digest()
            if (int.from_bytes(digest, "little") % 5 == 0) == (name == "eval"):
                out.setdefault((a, b), Example(prompt=f"{a}*{b}=", answer=str(a * b)))
        return list(out.values())
