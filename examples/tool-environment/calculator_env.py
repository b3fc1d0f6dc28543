"""A multi-turn environment with a tool, as a plug-in: `calculator_env:make` in a recipe.

The prompts are the calc task's products ("37*46=", answer "1702"). The model may call the tool
by writing `calc(A*B)` (or + or -): the environment answers `= RESULT` as a tool message and the
model takes another turn. A turn without a call is the answer: reward 1 when it is exact, else 0,
and the episode ends. Each step reports counts (`tool_calls`, `tool_errors`, and on the answer
`solved_with_tool`), summed over the trajectory and shown per training step in metrics.jsonl as
`env_tool_calls`, `env_tool_errors` and `env_solved_with_tool`.
"""

import operator
import re

from shared.envs.base import Environment, Message, Step, Tool

CALL = re.compile(r"calc\(([^)]*)\)")
BINARY = re.compile(r"\s*(\d+)\s*([-+*])\s*(\d+)\s*")
OPERATIONS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


class Calculator(Environment):
    tools = (
        Tool(
            "calc",
            "Multiply, add or subtract two integers: calc(A*B), calc(A+B), calc(A-B).",
            {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
        ),
    )

    def reset(self, task):
        """The first messages; `task` holds the row's prompt and answer (and its task_id, is_eval)."""
        self.answer = str(task["answer"]).strip()
        self.results = set()
        return [Message("user", str(task["prompt"]))]

    def step(self, model_turn):
        """The tool's result for a call; for an answer, its reward and the end of the episode."""
        call = CALL.search(model_turn)
        if call is None:
            right = model_turn.strip() == self.answer
            return Step([], float(right), True, {"solved_with_tool": float(right and self.answer in self.results)})
        expression = BINARY.fullmatch(call.group(1))
        if expression is None:  # a short reason: the tool's answer counts against the token budget
            return Step([Message("tool", "error: A*B only")], 0.0, False, {"tool_calls": 1.0, "tool_errors": 1.0})
        a, op, b = expression.groups()
        result = str(OPERATIONS[op](int(a), int(b)))
        self.results.add(result)
        return Step([Message("tool", f"= {result}")], 0.0, False, {"tool_calls": 1.0})


def make() -> Calculator:
    """The factory the recipe names: the replica makes one environment per trajectory."""
    return Calculator()
