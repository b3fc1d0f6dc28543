"""One multi-turn trajectory: the engine generates a turn, the environment answers, the answer's tokens are appended,
until the environment says done or a budget runs out.

The result is one record (`shared.rollouts.record.Rollout`): the model's tokens, with behaviour logprobs and versions,
and the environment's, interleaved after the prompt, a loss mask marking the model's. Messages become tokens by the
tokenizer's chat template, else as `role: content` lines. A failure ends with a `TrajectoryError` naming why.
`play` is the loop as a coroutine; `run_trajectory` runs it to its end from synchronous code.

Details: docs/internals/inference.md"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from shared.rollouts.sampling import Sampling

if TYPE_CHECKING:
    from shared.engines.base import Engine
from shared.envs.base import Environment, Message, Step


class TrajectoryError(Exception):
    """Why a trajectory ended early: a reason code and its message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Budget:
    max_turns: int = 4
    """Model turns at most."""
    max_tokens: int = 512
    """Completion tokens (the model's and the environment's) at most."""
    env_seconds: float = 10.0
    """One environment call at most (reset or step)."""


@dataclass
class Trajectory:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    finish_reason: str = ""  # done | max_turns | max_tokens
    routing_trace: np.ndarray | None = None  # [P + C − 1, layers, top_k] when the engine gives traces
    num_experts: int = 0
    env_metrics: dict[str, float] = field(default_factory=dict)  # Step.info summed over the steps
    reward_error: str = ""  # why the task's reward could not score it (then 0); empty when it did

    def add(
        self, tokens: list[int], model: bool, logprobs: list[float] | None = None, versions: list[int] | None = None
    ) -> None:
        last = self.versions[-1] if self.versions else 0
        self.token_ids += tokens
        self.loss_mask += [model] * len(tokens)
        self.logprobs += logprobs if model else [0.0] * len(tokens)
        self.versions += versions if model else [last] * len(tokens)  # the environment's: the turn before's

    def add_trace(self, trace: np.ndarray | None, num_experts: int) -> None:
        """The routing of a turn's call: positions an earlier call computed keep that call's."""
        if trace is not None:
            if self.routing_trace is not None:
                trace = trace.copy()
                trace[: len(self.routing_trace)] = self.routing_trace
            self.routing_trace = trace
            self.num_experts = num_experts

    def arrays(self) -> dict[str, np.ndarray]:
        return {
            "completion_token_ids": np.asarray(self.token_ids, dtype=np.int32),
            "inference_logprobs": np.asarray(self.logprobs, dtype=np.float32),
            "policy_versions": np.asarray(self.versions, dtype=np.uint64),
            "loss_mask": np.asarray(self.loss_mask, dtype=bool),
        }


def _template(tokenizer, messages: list[Message], generation_prompt: bool, tools: list | None = None) -> list[int]:
    rendered = tokenizer.apply_chat_template(
        [{"role": m.role, "content": m.content} for m in messages],
        add_generation_prompt=generation_prompt,
        tokenize=True,
        **({"tools": tools} if tools else {}),
    )
    return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)


def render(
    tokenizer, conversation: list[Message], new: list[Message], sampled: list[int] = (), tools: list | None = None
) -> list[int]:
    """The tokens that follow the tokens so far: the first call (`conversation` empty) the prompt;
    after a model turn (the last message of `conversation`, sampled as `sampled`), what the
    template closes that turn with (unless the model sampled it: an end-of-turn token), the
    messages `new`, and the generation prompt of the model's next turn. `tools`: declared to the
    template (OpenAI function schemas), as an agent's request declares them."""
    if not getattr(tokenizer, "chat_template", None):
        text = "".join(f"{m.role}: {m.content}\n" for m in new) + "assistant: "
        return list(tokenizer.encode(("\n" if conversation else "") + text, add_special_tokens=False))
    if not conversation:
        return _template(tokenizer, new, True, tools)
    head = _template(tokenizer, conversation[:-1], True, tools)  # up to the model turn's start
    turn = list(tokenizer.encode(conversation[-1].content, add_special_tokens=False))
    after = _template(tokenizer, [*conversation, *new], True, tools)
    if after[: len(head)] != head or after[len(head) : len(head) + len(turn)] != turn:
        raise TrajectoryError("template_mismatch", "the chat template renders the turns so far differently")
    tail = after[len(head) + len(turn) :]
    if sampled and tail and sampled[-1] == tail[0] and sampled[-1] not in turn:  # the model closed its turn itself
        tail = tail[1:]
    return tail


def _settle(future: asyncio.Future, result, error: BaseException | None) -> None:
    if not future.done():  # abandoned (timed out, cancelled): nobody waits for it any more
        future.set_exception(error) if error is not None else future.set_result(result)


def in_daemon_thread(function, *args) -> asyncio.Future:
    """`function(*args)` on a daemon thread of its own, as a future of the running loop."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def run() -> None:
        result = None
        error = None
        try:
            result = function(*args)
        except Exception as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            error = exc
        except BaseException as exc:  # noqa: BLE001 - SystemExit & co. from user code: an error, not an exit
            error = RuntimeError(repr(exc))
        with contextlib.suppress(RuntimeError):  # the loop is closed: the process is stopping
            loop.call_soon_threadsafe(_settle, future, result, error)

    threading.Thread(target=run, name="steadyrl-env", daemon=True).start()
    return future


async def _call(function, *args, seconds: float, what: str):
    future = in_daemon_thread(function, *args)
    try:
        return await asyncio.wait_for(future, seconds)
    except TimeoutError:
        raise TrajectoryError("env_timeout", f"{what} took over {seconds:g} s") from None
    except (TrajectoryError, asyncio.CancelledError):
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the environment raises ends the trajectory, named
        raise TrajectoryError("env_error", f"{what} raised {type(exc).__name__}: {exc}") from None


def _messages(value, what: str) -> list[Message]:
    if not isinstance(value, list) or not all(isinstance(m, Message) for m in value):
        raise TrajectoryError("malformed_observation", f"{what} returned {type(value).__name__}, not a list of Message")
    return value


def _step(value) -> Step:
    if not isinstance(value, Step):
        raise TrajectoryError("malformed_observation", f"step returned {type(value).__name__}, not a Step")
    info = value.info
    if not isinstance(info, dict) or not all(
        isinstance(k, str) and isinstance(v, int | float) and math.isfinite(v) for k, v in info.items()
    ):
        raise TrajectoryError("malformed_observation", f"step info {info!r} is not names → finite numbers")
    if not isinstance(value.reward, int | float) or not math.isfinite(value.reward):
        raise TrajectoryError("malformed_observation", f"step reward {value.reward!r} is not a finite number")
    _messages(value.observation, "step")
    return value


async def play(
    engine: Engine,
    tokenizer,
    env: Environment,
    task: dict,
    sampling: Sampling,
    budget: Budget = Budget(),
    return_trace: bool = False,
    index: int = 0,
) -> Trajectory:
    """Play one episode of `env` on `task` with `engine`; the model's turns are sampled with `sampling`
    (its max_new_tokens per turn, capped by what is left of the budget; seeded sampling uses
    seed + index + 4096 × turn). Cancelling it cancels the turn the engine is generating."""
    conversation = _messages(await _call(env.reset, task, seconds=budget.env_seconds, what="reset"), "reset")
    prompt = render(tokenizer, [], conversation)
    trajectory = Trajectory(prompt)
    while True:
        left = budget.max_tokens - len(trajectory.token_ids)
        if trajectory.turns >= budget.max_turns or left <= 0:
            trajectory.finish_reason = "max_turns" if trajectory.turns >= budget.max_turns else "max_tokens"
            return trajectory
        turn_sampling = Sampling(**{**vars(sampling), "max_new_tokens": min(sampling.max_new_tokens, left)})
        future = engine.start(
            prompt + trajectory.token_ids, turn_sampling, return_trace, index=index + 4096 * trajectory.turns
        )
        sample = await asyncio.wrap_future(future)  # cancelled: cancels the engine's sequence too
        trajectory.add(list(sample.token_ids), True, list(sample.logprobs), list(sample.versions))
        trajectory.add_trace(sample.routing_trace, sample.num_experts)
        trajectory.turns += 1
        text = tokenizer.decode(sample.token_ids, skip_special_tokens=True)
        step = _step(await _call(env.step, text, seconds=budget.env_seconds, what="step"))
        trajectory.reward = float(step.reward)
        for key, value in step.info.items():
            trajectory.env_metrics[key] = trajectory.env_metrics.get(key, 0.0) + float(value)
        if step.done:
            trajectory.finish_reason = "done"
            return trajectory
        conversation.append(Message("assistant", text))
        tokens = render(tokenizer, conversation, step.observation, list(sample.token_ids))
        conversation += step.observation
        if len(trajectory.token_ids) + len(tokens) > budget.max_tokens:
            raise TrajectoryError(
                "over_budget", f"the observation's {len(tokens)} tokens overflow the {budget.max_tokens}-token budget"
            )
        trajectory.add(tokens, False)


def run_trajectory(
    engine: Engine,
    tokenizer,
    env: Environment,
    task: dict,
    sampling: Sampling,
    budget: Budget = Budget(),
    return_trace: bool = False,
) -> Trajectory:
    """`play` to its end, from code that runs no event loop."""
    return asyncio.run(play(engine, tokenizer, env, task, sampling, budget, return_trace))
