"""The environment protocol of multi-turn rollouts: `reset(task)` gives the first messages,
`step(model_turn)` answers the model's turn with observation messages, a reward and whether the
episode is done. Tools are declared in the OpenAI function-call schema. A single-turn task is the
one-step case (`SingleTurn`): reset gives the prompt, the first step scores the answer, done.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Message:
    role: str  # system | user | assistant | tool
    content: str


@dataclass(frozen=True)
class Tool:
    """A tool the model may call, as the OpenAI function-call schema declares it."""

    name: str
    description: str
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    def openai(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass(frozen=True)
class Step:
    observation: list[Message]  # what the environment answers (empty when done)
    reward: float
    done: bool
    info: dict[str, float] = field(default_factory=dict)
    """Counts of this step (e.g. tool_calls: 1), summed over the trajectory into the rollout's
    env_metrics and averaged per training step in metrics.jsonl."""


class Environment(ABC):
    """One episode at a time (a replica makes one per trajectory)."""

    tools: tuple[Tool, ...] = ()

    @abstractmethod
    def reset(self, task: dict[str, Any]) -> list[Message]:
        """The episode's first messages for `task` (its prompt, its answer, anything the env needs)."""

    @abstractmethod
    def step(self, model_turn: str) -> Step:
        """The environment's answer to one model turn."""


class SingleTurn(Environment):
    """Today's tasks as environments: the prompt, then one answer scored by `reward(answer, reference)`."""

    def __init__(self, reward: Callable[[str, str], float]) -> None:
        self.reward = reward
        self.answer = ""

    def reset(self, task: dict[str, Any]) -> list[Message]:
        self.answer = str(task["answer"])
        return [Message("user", str(task["prompt"]))]

    def step(self, model_turn: str) -> Step:
        return Step([], float(self.reward(model_turn, self.answer)), True)
