"""Environment plug-ins the tests load by dotted path (`tests.envs:<name>`), as a user's would be."""

import time

from shared.envs.base import Environment, Message, Step


class Echo(Environment):
    """Answers each of the first two turns with `=42` (counting a tool call), then done with reward
    1 at the third."""

    def reset(self, task):
        self.turns = 0
        return [Message("user", task["prompt"])]

    def step(self, model_turn):
        self.turns += 1
        if self.turns >= 3:
            return Step([], 1.0, True, {"answered": 1.0})
        return Step([Message("tool", "=42")], 0.0, False, {"tool_calls": 1.0})


class Raises(Echo):
    def step(self, model_turn):
        raise RuntimeError("an environment bug")


class Hangs(Echo):
    def step(self, model_turn):
        time.sleep(3600)


class Malformed(Echo):
    def step(self, model_turn):
        return {"observation": "not a Step"}


class Floods(Echo):
    """An observation longer than any budget."""

    def step(self, model_turn):
        return Step([Message("tool", "=" + "9" * 200)], 0.0, False)


def not_an_environment():
    return 42
