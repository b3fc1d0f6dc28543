"""A calculator tool environment: the model may call `calc(EXPRESSION)` (integers, + - * and
parentheses) and reads `= RESULT` back; a turn without a call is its answer, rewarded 1 when it
holds the task's answer exactly (after stripping), else 0."""

from __future__ import annotations

import ast
import operator
import re
from typing import Any

from shared.envs.base import Environment, Message, Step, Tool

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
    tools = (Tool("calc", "Evaluate an integer expression of + - * and parentheses.",
                  {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}),)

    def __init__(self) -> None:
        self.answer = ""

    def reset(self, task: dict[str, Any]) -> list[Message]:
        self.answer = str(task["answer"]).strip()
        return [Message("user", str(task["prompt"]))]

    def step(self, model_turn: str) -> Step:
        call = CALL.search(model_turn)
        if call is None:
            return Step([], float(model_turn.strip() == self.answer), True)
        try:
            result = f"= {evaluate(call.group(1))}"
        except ValueError as exc:
            result = f"error: {exc}"
        return Step([Message("tool", result)], 0.0, False)
