"""The environment protocol of multi-turn rollouts: `reset(task)` gives the first messages,
`step(model_turn)` answers the model's turn with observation messages, a reward and whether the
episode is done. Tools are declared in the OpenAI function-call schema. A single-turn task is the
one-step case (`SingleTurn`): reset gives the prompt, the first step scores the answer, done.

A recipe names an environment by a registered name or a `module:factory` path
(`orchestrator.trajectory.environment`; `shared.envs.environment_factory`); the replica makes one per
trajectory and calls it from a thread of its own, each call bounded by `trajectory.env_seconds`.
Guide: docs/guides/multi-turn.md.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Message:
    """One message of the conversation, rendered by the tokenizer's chat template."""

    role: str
    """system, user, assistant or tool."""
    content: str
    """Its text."""


@dataclass(frozen=True)
class Tool:
    """A tool the model may call, as the OpenAI function-call schema declares it."""

    name: str
    """The function's name, as the model calls it."""
    description: str
    """What it does, for the model."""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})
    """Its arguments as a JSON Schema object."""

    def openai(self) -> dict[str, Any]:
        """The tool as an entry of OpenAI's `tools` list."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass(frozen=True)
class Step:
    """The environment's answer to one model turn. Anything else (or a non-finite number) fails the
    trajectory as `malformed_observation`."""

    observation: list[Message]
    """The messages that answer the turn (a tool's result, a user's reply): their tokens join the
    trajectory out of the loss. Empty when done."""
    reward: float
    """The trajectory's reward when this step ends it (a finite number); the reward of the last step is
    the trajectory's, also when a budget ends it."""
    done: bool
    """Whether the episode ends here."""
    info: dict[str, float] = field(default_factory=dict)
    """Counts of this step (e.g. tool_calls: 1), summed over the trajectory into the rollout's
    env_metrics and averaged per training step in metrics.jsonl."""


class Environment(ABC):
    """A multi-turn environment: one episode at a time (a replica makes one per trajectory). Raising,
    or running past `trajectory.env_seconds` in a call, fails the trajectory (`env_error`,
    `env_timeout`) and dead-letters its task: a group is trained whole or not at all."""

    tools: tuple[Tool, ...] = ()
    """The tools the environment answers, each declared in the OpenAI function-call schema (`Tool.openai`)."""

    @abstractmethod
    def reset(self, task: dict[str, Any]) -> list[Message]:
        """The episode's first messages for `task`: a dict of the row's `prompt` and `answer`, the
        task's `task_id` and `is_eval`."""

    @abstractmethod
    def step(self, model_turn: str) -> Step:
        """The environment's answer to one model turn (its text, special tokens removed)."""


class SingleTurn(Environment):
    """A single-turn task as an environment: the prompt, then one answer scored by
    `reward(answer, reference)`, done."""

    def __init__(self, reward: Callable[[str, str], float]) -> None:
        self.reward = reward
        self.answer = ""

    def reset(self, task: dict[str, Any]) -> list[Message]:
        self.answer = str(task["answer"])
        return [Message("user", str(task["prompt"]))]

    def step(self, model_turn: str) -> Step:
        return Step([], float(self.reward(model_turn, self.answer)), True)
