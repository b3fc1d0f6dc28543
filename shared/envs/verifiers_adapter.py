"""`verifiers` environments (the optional extra `verifiers`, `pip install -e '.[verifiers]'`; its classic API:
`load_environment()`) as a run's environment: `environment = "verifiers:ENV_ID"`, or
`"verifiers:ENV_ID {JSON}"` with `load_environment`'s keyword arguments.

A replica plays each dataset row's G trajectories with the environment's own rollout loop, its model calls answered
by the replica's OpenAI-compatible endpoint (one session per trajectory), and scores the group with the
environment's rubric: its reward is the rollout's, its metrics the rollout's `env_metrics`.

Details: docs/internals/inference.md"""

from __future__ import annotations

import asyncio
import functools
import json
from typing import Any

from shared.envs.base import Message
from shared.tasks.registry import Example

PREFIX = "verifiers:"
MODEL = "steadyrl"  # the model name the environment's client sends (the replica serves one model)


def parse(environment: str) -> tuple[str, dict[str, Any]]:
    """(ENV_ID, its load_environment arguments) of `verifiers:ENV_ID [{JSON}]`; ValueError naming what is wrong."""
    env_id, _, args = environment[len(PREFIX) :].strip().partition(" ")
    if not environment.startswith(PREFIX) or not env_id:
        raise ValueError(f"a verifiers environment is named verifiers:ENV_ID [{{JSON}}], not {environment!r}")
    try:
        kwargs = json.loads(args) if args.strip() else {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"{environment!r}: the arguments after the id are not JSON ({exc.msg})") from None
    if not isinstance(kwargs, dict):
        raise ValueError(f"{environment!r}: the arguments after the id are a JSON object of keyword arguments")
    return env_id, kwargs


@functools.lru_cache(maxsize=8)
def load(environment: str):
    """The environment (one per process and name). ValueError when verifiers is missing or the
    environment cannot be loaded."""
    env_id, kwargs = parse(environment)
    try:
        import verifiers as vf
    except ImportError as exc:
        raise ValueError(
            f"{environment!r} needs the verifiers package: from the repository, "
            f".venv/bin/pip install -e '.[verifiers]' ({exc})"
        ) from None
    try:
        env = vf.load_environment(env_id, **kwargs)
    except Exception as exc:  # noqa: BLE001 - whatever the plug-in raises, named
        raise ValueError(f"verifiers environment {env_id!r} could not be loaded: {type(exc).__name__}: {exc}") from None
    if not isinstance(env, vf.Environment):
        raise ValueError(f"verifiers environment {env_id!r}: load_environment returned a {type(env).__name__}")
    return env


def examples(environment: str, split: str, size: int) -> list[Example]:
    """Up to `size` rows of the environment's train or eval dataset (its eval falls back to its
    train set, as verifiers does), each row whole as the example's prompt (JSON)."""
    env = load(environment)
    rows = env.get_dataset(size) if split == "train" else env.get_eval_dataset(size)
    out = []
    for row in rows:
        record = {k: row[k] for k in ("prompt", "answer", "info", "task", "example_id") if k in row}
        out.append(Example(prompt=json.dumps(record, default=str), answer=str(row.get("answer", ""))))
    return out


def row_of(prompt_text: str) -> dict[str, Any]:
    """The dataset row a task carries; ValueError when it is not one."""
    try:
        row = json.loads(prompt_text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"a verifiers task's prompt_text is its dataset row as JSON ({exc.msg})") from None
    if not isinstance(row, dict) or not isinstance(row.get("prompt"), list) or not row["prompt"]:
        raise ValueError("a verifiers task's row needs a non-empty list of prompt messages")
    return row


def prompt_messages(prompt_text: str) -> list[Message]:
    """The row's opening messages (what the first call renders)."""
    return [Message(str(m.get("role", "user")), str(m.get("content") or "")) for m in row_of(prompt_text)["prompt"]]


async def play_group(
    environment: str,
    row: dict[str, Any],
    sessions: list[tuple[str, str]],
    sampling_args: dict[str, Any],
    seconds: float,
) -> list[tuple[float, dict[str, float], str]]:
    """The row's trajectories, one per session (its base URL and key), played by the environment's
    rollout loop and scored by its rubric together: (reward, metrics, error — '' when none) of
    each. TimeoutError past `seconds`; an exception of the environment's own code propagates."""
    from openai import AsyncOpenAI
    from verifiers.clients import OpenAIChatCompletionsClient

    env = load(environment)
    clients = [AsyncOpenAI(base_url=url, api_key=key, timeout=seconds, max_retries=0) for url, key in sessions]
    try:
        async with asyncio.timeout(seconds):
            states = await asyncio.gather(
                *(
                    env.rollout(dict(row), OpenAIChatCompletionsClient(client), MODEL, dict(sampling_args))
                    for client in clients
                )
            )
            await env.rubric.score_group(states)
            for state in states:
                await env.rubric.cleanup(state)
    finally:
        for client in clients:
            await client.close()
    return [
        (
            float(s["reward"] or 0.0),
            {k: float(v) for k, v in (s["metrics"] or {}).items()},
            "" if s.get("error") is None else f"{type(s['error']).__name__}: {s['error']}",
        )
        for s in states
    ]
