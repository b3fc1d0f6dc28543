"""Agent programs drive rollouts through an OpenAI-compatible endpoint on the replica (the replica's side of
`shared.envs.agent_protocol`).

An `agent:COMMAND` task runs COMMAND once per trajectory (`agent_programs.py`: isolated, `OPENAI_BASE_URL` at this
replica's `/rollouts/SESSION/v1`, `OPENAI_API_KEY` the session's key, the prompt in `STEADYRL_PROMPT`); its last
stdout line is its answer. A `verifiers:ENV_ID` task runs that environment's own rollout loop
(`shared.envs.verifiers_adapter`). Each `POST …/chat/completions` is rendered and sampled like any turn; a refused
call (4xx) changes nothing. Failures: `env_timeout`, `env_error`, `over_budget`, `template_mismatch`.

Details: docs/internals/inference.md"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hmac
import logging
import os
import secrets
import shlex
import shutil
import socket
import tempfile
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request

from services.inference import agent_programs, agent_wire
from services.inference.agent_programs import AgentIsolation
from services.inference.agent_wire import (
    MAX_BODY_BYTES,
    BadCall,
    TooLarge,
    completion,
    messages_of,
    read_body,
    sampling_of,
)
from shared.engines import Engine, Sampling
from shared.envs import agent_protocol
from shared.envs.base import Message
from shared.envs.trajectory import Budget, Trajectory, TrajectoryError, render

log = logging.getLogger("steadyrl.inference.agents")
PREFIX = "agent:"


@dataclass
class Session:
    task_id: str
    sampling: Sampling
    budget: Budget
    return_trace: bool
    index: int
    key: str = field(default_factory=lambda: secrets.token_urlsafe(32))  # every call carries it
    trajectory: Trajectory | None = None
    conversation: list[Message] = field(default_factory=list)
    sampled: list[int] = field(default_factory=list)
    error: TrajectoryError | None = None
    refused: str = ""  # why the last refused call was refused (named if the program then fails)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


@dataclass
class Call:
    """A checked call, not yet applied: the messages it adds, their tokens and its sampling."""

    messages: list[Message]
    new: list[Message]
    tokens: list[int]
    sampling: Sampling
    logprobs: bool


class Endpoint:
    """The replica's agent sessions and its OpenAI-compatible app (served on loopback)."""

    def __init__(
        self,
        engine: Engine,
        tokenizer,
        base_url: str,
        isolation: AgentIsolation | None = None,
        max_body_bytes: int = MAX_BODY_BYTES,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.base_url = base_url
        self.isolation = isolation or AgentIsolation()
        self.max_body_bytes = max_body_bytes
        self.sessions: dict[str, Session] = {}

    def app(self) -> FastAPI:
        app = FastAPI(
            title="steadyrl replica: OpenAI-compatible chat for agent programs",
            docs_url=None,
            redoc_url=None,
            openapi_url=None,
        )

        @app.exception_handler(Exception)
        async def internal(request: Request, exc: Exception):
            log.warning("event=agent_call_failed error=%s: %s", type(exc).__name__, exc)
            return agent_wire.error(500, "internal", "the call failed inside the replica")

        @app.post("/rollouts/{session_id}/v1/chat/completions")
        async def chat(session_id: str, request: Request):
            session = self.sessions.get(session_id)
            if session is None:
                return agent_wire.error(404, "not_found", f"no rollout session {session_id!r}")
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {session.key}".encode()):
                return agent_wire.error(
                    401, "unauthorized", "this session's key is required (Authorization: Bearer KEY)"
                )
            try:
                body = await read_body(request, self.max_body_bytes)
                async with session.lock:  # one call of a conversation at a time
                    call = await asyncio.to_thread(self.check, session, body)
                    return await self.call(session, call)
            except TooLarge as exc:
                return agent_wire.error(413, "too_large", str(exc))
            except TrajectoryError as exc:
                session.error = session.error or exc
                return agent_wire.error(400, exc.code, exc.message)
            except (BadCall, ValueError) as exc:
                session.refused = str(exc)
                return agent_wire.error(400, "invalid_request", f"bad request: {exc}")

        return app

    def check(self, session: Session, body) -> Call:
        """Read a call's body, check every value and render its tokens; changes nothing (BadCall
        or TrajectoryError when it cannot be served)."""
        if not isinstance(body, dict):
            raise BadCall("the body must be a JSON object")
        messages = messages_of(body.get("messages"))
        tools = body.get("tools") or None
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise BadCall("tools must be a list of objects")
        if body.get("stream"):
            raise BadCall("streaming is not served: call without stream")
        if body.get("n", 1) != 1:
            raise BadCall("one completion per call (n = 1)")
        logprobs = body.get("logprobs", False)
        if not isinstance(logprobs, bool):
            raise BadCall("logprobs must be true or false")
        if session.error is not None:
            raise session.error
        t = session.trajectory
        if t is None:
            new = messages
            tokens = render(self.tokenizer, [], messages, tools=tools)
            used = 0
        else:
            seen = len(session.conversation)  # its last message: the model's turn, as sampled
            if len(messages) <= seen or [_key(m) for m in messages[:seen]] != [_key(m) for m in session.conversation]:
                raise TrajectoryError("template_mismatch", "the call does not continue the conversation so far")
            new = messages[seen:]
            tokens = render(self.tokenizer, session.conversation, new, session.sampled, tools=tools)
            used = len(t.token_ids)
            if used + len(tokens) > session.budget.max_tokens:
                raise TrajectoryError(
                    "over_budget",
                    f"the call's {len(tokens)} new tokens overflow the {session.budget.max_tokens}-token budget",
                )
            used += len(tokens)
        left = session.budget.max_tokens - used
        if (t is not None and t.turns >= session.budget.max_turns) or left <= 0:
            raise TrajectoryError("over_budget", f"a call past the budget ({t.turns if t else 0} turns, {used} tokens)")
        sampling = sampling_of(body, session.sampling, left)
        context = (len(t.prompt_token_ids) + used if t is not None else len(tokens)) + sampling.max_new_tokens
        if context > self.engine.max_model_len:
            raise BadCall(
                f"the conversation and max_tokens ({context} tokens) exceed the model's {self.engine.max_model_len}"
            )
        return Call(messages, new, tokens, sampling, logprobs)

    async def call(self, session: Session, call: Call) -> dict:
        """Sample the model's turn of a checked call; the session changes once the turn is there."""
        t = session.trajectory
        prompt = call.tokens if t is None else [*t.prompt_token_ids, *t.token_ids, *call.tokens]
        turns = t.turns if t is not None else 0
        future = self.engine.start(prompt, call.sampling, session.return_trace, index=session.index + 4096 * turns)
        sample = await asyncio.wrap_future(future)
        if t is None:
            t = session.trajectory = Trajectory(list(call.tokens))
            session.conversation = list(call.messages)
        else:
            t.add(call.tokens, False)
            session.conversation += call.new
        t.add(list(sample.token_ids), True, list(sample.logprobs), list(sample.versions))
        t.add_trace(sample.routing_trace, sample.num_experts)
        t.turns += 1
        text = self.tokenizer.decode(sample.token_ids, skip_special_tokens=True)
        session.sampled = list(sample.token_ids)
        session.conversation.append(Message("assistant", text))
        return completion(session, text, sample, self.tokenizer, call.logprobs)

    @contextlib.contextmanager
    def session(self, task, sampling: Sampling, budget: Budget, return_trace: bool, index: int):
        """A rollout session: (it, its OpenAI base URL) while open."""
        session_id = f"{task.task_id}.{index}.{uuid.uuid4().hex[:8]}"
        session = self.sessions[session_id] = Session(task.task_id, sampling, budget, return_trace, index)
        try:
            yield session, f"{self.base_url}/rollouts/{session_id}/v1"
        finally:
            self.sessions.pop(session_id, None)

    async def play(
        self, task, prompt: str, sampling: Sampling, budget: Budget, return_trace: bool, index: int
    ) -> Trajectory:
        """Run the task's agent program once; its trajectory, its answer scored by the task's reward."""
        refused = self.isolation.refused()
        if refused is not None:
            raise TrajectoryError("no_isolation", refused)
        command = shlex.split(task.environment[len(PREFIX) :])
        with self.session(task, sampling, budget, return_trace, index) as (session, url):
            env = agent_protocol.program_environment(url, session.key, prompt)
            try:
                status, out, err = await agent_programs.run(command, env, self.isolation, budget.env_seconds)
            except TimeoutError:
                raise TrajectoryError("env_timeout", f"the agent ran over {budget.env_seconds:g} s") from None
            except OSError as exc:
                raise TrajectoryError("env_error", f"the agent {command[0]!r} could not start: {exc}") from None
        if session.error is not None:
            raise session.error
        if status != 0:
            after = f" (after a refused call: {session.refused[:200]})" if session.refused else ""
            raise TrajectoryError("env_error", f"the agent exited {status}{after}: {err[-300:]}")
        trajectory = _recorded(session, "the agent")
        trajectory.reward, trajectory.reward_error = await asyncio.to_thread(
            _score, task.task_name, agent_protocol.answer_of(out), task.answer, task.reward_row
        )
        trajectory.finish_reason = "done"
        trajectory.env_metrics = {"model_calls": float(trajectory.turns)}
        return trajectory

    async def play_verifiers(self, task, sampling: Sampling, budget: Budget, return_trace: bool) -> list[Trajectory]:
        """The task's G trajectories played by its verifiers environment against G sessions, scored
        by the environment's rubric (`shared.envs.verifiers_adapter`); bounded by env_seconds."""
        from shared.envs import verifiers_adapter

        args = {"max_tokens": sampling.max_new_tokens, "temperature": sampling.temperature, "top_p": sampling.top_p}
        with contextlib.ExitStack() as stack:
            opened = [
                stack.enter_context(self.session(task, sampling, budget, return_trace, i))
                for i in range(task.group_size)
            ]
            try:
                scored = await verifiers_adapter.play_group(
                    task.environment,
                    verifiers_adapter.row_of(task.prompt_text),
                    [(url, s.key) for s, url in opened],
                    args,
                    budget.env_seconds,
                )
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
            trajectory.reward = reward
            trajectory.finish_reason = "done"
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


def _score(reward: str, answer: str, reference: str, row: str) -> tuple[float, str]:
    """(reward, why it could not be scored: '' when it was); `row`: the task's, checked with its lease."""
    from shared.tasks.registry import score
    from shared.tasks.reward_contract import Row

    loaded = _loaded(reward)
    return score(loaded.fn, answer, reference, loaded.keywords(Row.from_json(row)))


@functools.lru_cache(maxsize=64)
def _loaded(reward: str):
    """The reward, its signature read once per name."""
    from shared.tasks.registry import load_reward

    return load_reward(reward)


@contextlib.asynccontextmanager
async def served_endpoint(engine: Engine, tokenizer, settings) -> AsyncIterator[Endpoint]:
    """The agent endpoint, served while open on a free loopback port and on a unix socket in a directory of its
    own, the one an isolated agent program reaches from its network namespace (`settings`: the replica's). The
    socket's directory goes when the server stops."""
    import uvicorn

    tcp = socket.create_server(("127.0.0.1", 0))
    port = tcp.getsockname()[1]
    directory = tempfile.mkdtemp(prefix="steadyrl-agents-")  # 0700: this user's alone
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(os.path.join(directory, "endpoint.sock"))
    unix.listen(128)
    isolation = dataclasses.replace(settings.agent_isolation_of(), endpoint=(Path(unix.getsockname()), port))
    endpoint = Endpoint(engine, tokenizer, f"http://127.0.0.1:{port}", isolation, settings.agent.max_body_bytes)
    server = uvicorn.Server(uvicorn.Config(endpoint.app(), log_level="warning", lifespan="off"))
    serving = asyncio.create_task(server.serve(sockets=[tcp, unix]))
    serving.add_done_callback(lambda _: shutil.rmtree(directory, ignore_errors=True))
    try:
        while not server.started:
            if serving.done():
                raise RuntimeError(f"the agent endpoint did not start: {serving.exception()!r}")
            await asyncio.sleep(0.02)
        log.info("event=agent_endpoint url=%s socket=%s", endpoint.base_url, isolation.endpoint[0])
        yield endpoint
    finally:
        server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(serving, 5)
