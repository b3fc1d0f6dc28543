"""Environments of multi-turn rollouts, by name: a registered one (`calc`) or a plug-in given as
`package.module:factory` (a class or function returning an `Environment`, imported where the
replica runs). A replica makes one environment per trajectory."""

from __future__ import annotations

from collections.abc import Callable

from shared.envs.base import Environment
from shared.tasks.registry import DOTTED, import_plugin


def _calc() -> Environment:
    from shared.envs.calc import Calculator

    return Calculator()


ENVIRONMENTS: dict[str, Callable[[], Environment]] = {"calc": _calc}
"""The registered environments by name: each a factory of a fresh `Environment`."""


def environment_factory(name: str) -> Callable[[], Environment]:
    """What makes the environment `name`; KeyError naming why when there is none."""
    if name in ENVIRONMENTS:
        return ENVIRONMENTS[name]
    if not DOTTED.match(name):
        raise KeyError(f"no environment named {name!r}; registered: {sorted(ENVIRONMENTS)}, or give module:factory")
    return import_plugin(name, "environment")


def make_environment(name: str) -> Environment:
    """A fresh environment `name` (KeyError when unknown, TypeError when the factory makes something else)."""
    env = environment_factory(name)()
    if not isinstance(env, Environment):
        raise TypeError(f"environment {name!r} made a {type(env).__name__}, not a shared.envs.base.Environment")
    return env
