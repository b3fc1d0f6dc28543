"""Agent programs drive rollouts through an OpenAI-compatible endpoint on the replica.

A task whose environment is `agent:COMMAND` is played by running COMMAND (an unmodified program
that speaks the OpenAI chat API) once per trajectory, with `OPENAI_BASE_URL` pointing at this
replica's `/rollouts/SESSION/v1` and the task's prompt in `STEADYRL_PROMPT`; one whose environment
is `verifiers:ENV_ID` by that environment's own rollout loop, a client per trajectory pointing at
such a session (`shared.envs.verifiers_adapter`), scored by its rubric. Every
`POST …/chat/completions` (messages, `tools`, temperature, top_p, max_tokens or
max_completion_tokens, logprobs) is rendered by the tokenizer's chat template and sampled by the
engine like any turn: the call's new messages are the environment's tokens (masked out), its
completion the model's (behaviour logprobs and versions kept, routing traces composed), and each
call must continue the conversation so far (else `template_mismatch`). An agent program's last
line on stdout is its answer, scored by the task's reward against the task's answer. The whole
program (or group of rollouts) is bounded by the task's `env_seconds` (then killed:
`env_timeout`); an exit status other than 0, or an environment that raises, is `env_error`; a call
past the turn or token budget is answered 400 and ends the trajectory (`over_budget`).

Tool calls in the Hermes format the Qwen templates use (`<tool_call>{"name": …, "arguments": …}
</tool_call>`) come back as the message's `tool_calls`; the conversation keeps the text as sampled.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shlex
import signal
import time
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from shared.engines import Engine, Sampling
from shared.envs.base import Message
from shared.envs.trajectory import Budget, Trajectory, TrajectoryError, render

PREFIX = "agent:"
TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


@dataclass
class Session:
    task_id: str
    sampling: Sampling
    budget: Budget
    return_trace: bool
    index: int
    trajectory: Trajectory | None = None
    conversation: list[Message] = field(default_factory=list)
    sampled: list[int] = field(default_factory=list)
    error: TrajectoryError | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class Endpoint:
    """The replica's agent sessions and its OpenAI-compatible app (served on loopback)."""

    def __init__(self, engine: Engine, tokenizer, base_url: str) -> None:
        self.engine, self.tokenizer, self.base_url = engine, tokenizer, base_url
        self.sessions: dict[str, Session] = {}

    def app(self) -> FastAPI:
        app = FastAPI(title="steadyrl replica: OpenAI-compatible chat for agent programs")

        @app.post("/rollouts/{session_id}/v1/chat/completions")
        async def chat(session_id: str, request: Request):
            session = self.sessions.get(session_id)
            if session is None:
                return JSONResponse({"error": {"message": f"no rollout session {session_id!r}", "type": "not_found"}},
                                    404)
            try:
                body = await request.json()
                if not isinstance(body, dict) or not isinstance(body.get("messages"), list) or not body["messages"]:
                    raise ValueError("the body needs a non-empty list of messages")
                async with session.lock:  # one call of a conversation at a time
                    return await self.call(session, body)
            except TrajectoryError as exc:
                session.error = session.error or exc
                return JSONResponse({"error": {"message": str(exc), "type": exc.code}}, 400)
            except (ValueError, TypeError, KeyError) as exc:
                return JSONResponse({"error": {"message": f"bad request: {exc}", "type": "invalid_request"}}, 400)

        return app

    async def call(self, session: Session, body: dict) -> dict:
        messages = [Message(str(m["role"]), str(m.get("content") or "")) for m in body["messages"]]
        tools = body.get("tools") or None
        if session.error is not None:
            raise session.error
        if session.trajectory is None:
            session.trajectory = Trajectory(render(self.tokenizer, [], messages, tools=tools))
            session.conversation = list(messages)
        else:
            seen = len(session.conversation)  # its last message: the model's turn, as sampled
            if len(messages) <= seen or [_key(m) for m in messages[:seen]] != [_key(m) for m in session.conversation]:
                raise TrajectoryError("template_mismatch", "the call does not continue the conversation so far")
            new = messages[seen:]
            tokens = render(self.tokenizer, session.conversation, new, session.sampled, tools=tools)
            if len(session.trajectory.token_ids) + len(tokens) > session.budget.max_tokens:
                raise TrajectoryError("over_budget", f"the call's {len(tokens)} new tokens overflow the "
                                                     f"{session.budget.max_tokens}-token budget")
            session.trajectory.add(tokens, False)
            session.conversation += new
        t = session.trajectory
        left = session.budget.max_tokens - len(t.token_ids)
        if t.turns >= session.budget.max_turns or left <= 0:
            raise TrajectoryError("over_budget", f"a call past the budget ({t.turns} turns, {len(t.token_ids)} tokens)")
        sampling = Sampling(**{**vars(session.sampling), "max_new_tokens": min(int(body.get("max_completion_tokens") or
                                                                                    body.get("max_tokens") or
                                                                                    session.sampling.max_new_tokens), left),
                               "temperature": float(body.get("temperature", session.sampling.temperature)),
                               "top_p": float(body.get("top_p", session.sampling.top_p))})
        future = self.engine.start(t.prompt_token_ids + t.token_ids, sampling, session.return_trace,
                                   index=session.index + 4096 * t.turns)
        sample = await asyncio.wrap_future(future)
        t.add(list(sample.token_ids), True, list(sample.logprobs), list(sample.versions))
        t.add_trace(sample.routing_trace, sample.num_experts)
        t.turns += 1
        text = self.tokenizer.decode(sample.token_ids, skip_special_tokens=True)
        session.sampled = list(sample.token_ids)
        session.conversation.append(Message("assistant", text))
        return _completion(session, text, sample, self.tokenizer, bool(body.get("logprobs")))

    @contextlib.contextmanager
    def session(self, task, sampling: Sampling, budget: Budget, return_trace: bool, index: int):
        """A rollout session: (it, its OpenAI base URL) while open."""
        session_id = f"{task.task_id}.{index}.{uuid.uuid4().hex[:8]}"
        session = self.sessions[session_id] = Session(task.task_id, sampling, budget, return_trace, index)
        try:
            yield session, f"{self.base_url}/rollouts/{session_id}/v1"
        finally:
            self.sessions.pop(session_id, None)

    async def play(self, task, prompt: str, sampling: Sampling, budget: Budget, return_trace: bool,
                   index: int) -> Trajectory:
        """Run the task's agent program once; its trajectory, its answer scored by the task's reward."""
        command = shlex.split(task.environment[len(PREFIX):])
        with self.session(task, sampling, budget, return_trace, index) as (session, url):
            env = {**os.environ, "OPENAI_BASE_URL": url, "OPENAI_API_KEY": "steadyrl", "STEADYRL_PROMPT": prompt}
            try:
                process = await asyncio.create_subprocess_exec(*command, stdout=asyncio.subprocess.PIPE,
                                                               stderr=asyncio.subprocess.PIPE, env=env,
                                                               start_new_session=True)
            except OSError as exc:
                raise TrajectoryError("env_error", f"the agent {command[0]!r} could not start: {exc}") from None
            try:
                out, err = await asyncio.wait_for(process.communicate(), budget.env_seconds)
            except (TimeoutError, asyncio.CancelledError) as exc:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                await process.wait()
                if isinstance(exc, asyncio.CancelledError):
                    raise
                raise TrajectoryError("env_timeout", f"the agent ran over {budget.env_seconds:g} s") from None
        if session.error is not None:
            raise session.error
        if process.returncode != 0:
            raise TrajectoryError("env_error", f"the agent exited {process.returncode}: "
                                               f"{err.decode(errors='replace')[-300:]}")
        lines = [line for line in out.decode(errors="replace").splitlines() if line.strip()]
        trajectory = _recorded(session, "the agent")
        trajectory.reward = await asyncio.to_thread(_score, task.task_name, lines[-1] if lines else "", task.answer)
        trajectory.finish_reason, trajectory.env_metrics = "done", {"model_calls": float(trajectory.turns)}
        return trajectory

    async def play_verifiers(self, task, sampling: Sampling, budget: Budget, return_trace: bool) -> list[Trajectory]:
        """The task's G trajectories played by its verifiers environment against G sessions, scored
        by the environment's rubric (`shared.envs.verifiers_adapter`); bounded by env_seconds."""
        from shared.envs import verifiers_adapter

        args = {"max_tokens": sampling.max_new_tokens, "temperature": sampling.temperature, "top_p": sampling.top_p}
        with contextlib.ExitStack() as stack:
            opened = [stack.enter_context(self.session(task, sampling, budget, return_trace, i))
                      for i in range(task.group_size)]
            try:
                scored = await verifiers_adapter.play_group(task.environment, verifiers_adapter.row_of(task.prompt_text),
                                                            [url for _, url in opened], args, budget.env_seconds)
            except TimeoutError:
                raise TrajectoryError("env_timeout", f"the environment ran over {budget.env_seconds:g} s") from None
            except Exception as exc:  # noqa: BLE001 - the environment's own code failed: the task ends, named
                first = next((s.error for s, _ in opened if s.error is not None), None)
                raise first or TrajectoryError("env_error", f"{type(exc).__name__}: {exc}"[:300]) from None
        out = []
        for (session, _), (reward, metrics, error) in zip(opened, scored, strict=True):
            if session.error is not None:
                raise session.error
            if error:
                raise TrajectoryError("env_error", f"the environment's rollout failed: {error}"[:300])
            trajectory = _recorded(session, "the environment")
            trajectory.reward, trajectory.finish_reason = reward, "done"
            trajectory.env_metrics = {**metrics, "model_calls": float(trajectory.turns)}
            out.append(trajectory)
        return out


def _key(message: Message) -> tuple[str, str]:
    """What a call must repeat of the conversation so far: every message, an assistant one by its
    role alone (a client sends back the content it was given — tool calls parsed out — and the
    record keeps the turn as sampled)."""
    return (message.role, "" if message.role == "assistant" else message.content)


def _recorded(session: Session, who: str) -> Trajectory:
    if session.trajectory is None:
        raise TrajectoryError("env_error", f"{who} made no model call")
    return session.trajectory


def _score(reward: str, answer: str, reference: str) -> float:
    from shared.tasks import resolve_reward, score

    return score(resolve_reward(reward), answer, reference)[0]


def _completion(session: Session, text: str, sample, tokenizer, logprobs: bool) -> dict:
    calls = []
    for i, match in enumerate(TOOL_CALL.finditer(text)):
        with contextlib.suppress(ValueError, TypeError, AttributeError):
            call = json.loads(match.group(1))
            calls.append({"id": f"call_{session.index}_{session.trajectory.turns}_{i}", "type": "function",
                          "function": {"name": str(call["name"]), "arguments": json.dumps(call.get("arguments", {}))}})
    content = TOOL_CALL.sub("", text).strip() if calls else text
    message = {"role": "assistant", "content": content or None, **({"tool_calls": calls} if calls else {})}
    choice = {"index": 0, "message": message,
              "finish_reason": "tool_calls" if calls else ("length" if sample.finish_reason == "length" else "stop")}
    if logprobs:
        choice["logprobs"] = {"content": [{"token": tokenizer.decode([token]), "logprob": lp}
                                          for token, lp in zip(sample.token_ids, sample.logprobs, strict=True)]}
    prompt = len(session.trajectory.prompt_token_ids) + len(session.trajectory.token_ids) - len(sample.token_ids)
    return {"id": f"chatcmpl-{session.task_id}-{session.trajectory.turns}", "object": "chat.completion",
            "created": int(time.time()), "model": "steadyrl", "choices": [choice],
            "usage": {"prompt_tokens": prompt, "completion_tokens": len(sample.token_ids),
                      "total_tokens": prompt + len(sample.token_ids)}}
