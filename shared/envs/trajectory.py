"""One multi-turn trajectory: the engine generates a turn, the environment answers, the answer's
tokens are appended, until the environment says done or a budget runs out. The result is one
record — the model's tokens (with their behaviour logprobs and versions) and the environment's
interleaved after the prompt, and a loss mask marking the model's (`shared.rollout.Rollout`).

Messages become tokens by the tokenizer's chat template where it has one (an observation's
tokens are what rendering the conversation with it adds to rendering the conversation without
it, appended after the model's turn exactly as sampled; a template that rewrites earlier turns is
refused, `template_mismatch`), else as plain `role: content` lines. An
environment that raises, answers with something that is not a list of messages, hangs past
`env_seconds`, or a trajectory past its turn or token budget, ends with a `TrajectoryError`
naming why, for its caller to dead-letter the task with. A hung environment call is abandoned at
once, its thread left to finish whenever it returns (4 such threads: one that never returns holds
one of them for good).
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field

import numpy as np

from shared.engines.base import Engine, Sampling
from shared.envs.base import Environment, Message, Step

_ENV_THREADS = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="steadyrl-env")


class TrajectoryError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


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

    def add(self, tokens: list[int], model: bool, logprobs: list[float] | None = None,
            versions: list[int] | None = None) -> None:
        last = self.versions[-1] if self.versions else 0
        self.token_ids += tokens
        self.loss_mask += [model] * len(tokens)
        self.logprobs += logprobs if model else [0.0] * len(tokens)
        self.versions += versions if model else [last] * len(tokens)  # the environment's: the turn before's

    def arrays(self) -> dict[str, np.ndarray]:
        return {"completion_token_ids": np.asarray(self.token_ids, dtype=np.int32),
                "inference_logprobs": np.asarray(self.logprobs, dtype=np.float32),
                "policy_versions": np.asarray(self.versions, dtype=np.uint64),
                "loss_mask": np.asarray(self.loss_mask, dtype=bool)}


def _template(tokenizer, messages: list[Message], generation_prompt: bool) -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": m.role, "content": m.content} for m in messages],
                                             add_generation_prompt=generation_prompt, tokenize=True)
    return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)


def render(tokenizer, conversation: list[Message], new: list[Message], sampled: list[int] = ()) -> list[int]:
    """The tokens that follow the tokens so far: the first call (`conversation` empty) the prompt;
    after a model turn (the last message of `conversation`, sampled as `sampled`), what the
    template closes that turn with (unless the model sampled it: an end-of-turn token), the
    messages `new`, and the generation prompt of the model's next turn."""
    if not getattr(tokenizer, "chat_template", None):
        text = "".join(f"{m.role}: {m.content}\n" for m in new) + "assistant: "
        return list(tokenizer.encode(("\n" if conversation else "") + text, add_special_tokens=False))
    if not conversation:
        return _template(tokenizer, new, True)
    head = _template(tokenizer, conversation[:-1], True)  # up to the model turn's start
    turn = list(tokenizer.encode(conversation[-1].content, add_special_tokens=False))
    after = _template(tokenizer, [*conversation, *new], True)
    if after[: len(head)] != head or after[len(head) : len(head) + len(turn)] != turn:
        raise TrajectoryError("template_mismatch", "the chat template renders the turns so far differently")
    tail = after[len(head) + len(turn):]
    if sampled and tail and sampled[-1] == tail[0] and sampled[-1] not in turn:  # the model closed its turn itself
        tail = tail[1:]
    return tail


def _call(function, *args, seconds: float, what: str):
    future = _ENV_THREADS.submit(function, *args)
    try:
        return future.result(timeout=seconds)
    except concurrent.futures.TimeoutError:
        raise TrajectoryError("env_timeout", f"{what} took over {seconds:g} s") from None
    except TrajectoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the environment raises ends the trajectory, named
        raise TrajectoryError("env_error", f"{what} raised {type(exc).__name__}: {exc}") from None


def _messages(value, what: str) -> list[Message]:
    if not isinstance(value, list) or not all(isinstance(m, Message) for m in value):
        raise TrajectoryError("malformed_observation", f"{what} returned {type(value).__name__}, not a list of Message")
    return value


def run_trajectory(engine: Engine, tokenizer, env: Environment, task: dict, sampling: Sampling,
                   budget: Budget = Budget()) -> Trajectory:
    """Play one episode of `env` on `task` with `engine`; the model's turns are sampled with `sampling`
    (its max_new_tokens per turn, capped by what is left of the budget)."""
    conversation = _messages(_call(env.reset, task, seconds=budget.env_seconds, what="reset"), "reset")
    prompt = render(tokenizer, [], conversation)
    trajectory = Trajectory(prompt)
    while True:
        left = budget.max_tokens - len(trajectory.token_ids)
        if trajectory.turns >= budget.max_turns or left <= 0:
            trajectory.finish_reason = "max_turns" if trajectory.turns >= budget.max_turns else "max_tokens"
            return trajectory
        turn_sampling = Sampling(**{**vars(sampling), "max_new_tokens": min(sampling.max_new_tokens, left)})
        [sample] = engine.generate([prompt + trajectory.token_ids], turn_sampling)
        trajectory.add(list(sample.token_ids), True, list(sample.logprobs), list(sample.versions))
        trajectory.turns += 1
        text = tokenizer.decode(sample.token_ids, skip_special_tokens=True)
        step = _call(env.step, text, seconds=budget.env_seconds, what="step")
        if not isinstance(step, Step):
            raise TrajectoryError("malformed_observation", f"step returned {type(step).__name__}, not a Step")
        observation = _messages(step.observation, "step")
        trajectory.reward = float(step.reward)
        if step.done:
            trajectory.finish_reason = "done"
            return trajectory
        conversation.append(Message("assistant", text))
        tokens = render(tokenizer, conversation, observation, list(sample.token_ids))
        conversation += observation
        if len(trajectory.token_ids) + len(tokens) > budget.max_tokens:
            raise TrajectoryError("over_budget", f"the observation's {len(tokens)} tokens overflow the "
                                                 f"{budget.max_tokens}-token budget")
        trajectory.add(tokens, False)
