"""What a call to the agent endpoint is on the wire: its body read within a limit and parsed off
the event loop, its messages and sampling values checked one by one (`BadCall`: a JSON 400 that
changes nothing), and the OpenAI chat completion it gets back (Hermes `<tool_call>` blocks as
`tool_calls`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
import time

from fastapi import Request
from fastapi.responses import JSONResponse

from shared.envs.base import Message
from shared.rollouts.sampling import Sampling

TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_BODY_BYTES = 4 << 20


class BadCall(ValueError):
    """A call the endpoint refuses (400) without changing its session."""


class TooLarge(ValueError):
    """A body past the endpoint's limit (413)."""


def error(status: int, kind: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind}}, status)


async def read_body(request: Request, limit: int):
    """The request's JSON, read at most `limit` bytes (TooLarge past it), parsed off the loop."""
    length = request.headers.get("content-length", "")
    if length and (not length.isdigit() or int(length) > limit):
        raise TooLarge(f"the body is over the {limit}-byte limit")
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise TooLarge(f"the body is over the {limit}-byte limit")
        chunks.append(chunk)
    try:
        return await asyncio.to_thread(json.loads, b"".join(chunks))
    except (ValueError, RecursionError) as exc:
        raise BadCall(f"the body is not JSON: {str(exc)[:200]}") from None


def messages_of(value) -> list[Message]:
    """The call's messages: each a role of ROLES and a content that is text, null or a list of
    text parts (OpenAI's `[{"type": "text", "text": …}]`)."""
    if not isinstance(value, list) or not value:
        raise BadCall("the body needs a non-empty list of messages")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise BadCall(f"message {i} needs a role, one of {ROLES}")
        content = message.get("content")
        if isinstance(content, list):
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
            ):
                raise BadCall(f"message {i}: a list content holds text parts only")
            content = "".join(p["text"] for p in content)
        elif content is not None and not isinstance(content, str):
            raise BadCall(f"message {i}: content must be text, null or a list of text parts")
        out.append(Message(message["role"], content or ""))
    return out


def sampling_of(body: dict, base: Sampling, left: int) -> Sampling:
    """The call's sampling: the task's, with what the call sets (each value checked), its
    max_tokens within what the budget leaves."""

    def number(name: str, default: float) -> float:
        value = body.get(name, default)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise BadCall(f"{name} must be a finite number, got {value!r}")
        return float(value)

    limit = next((body[n] for n in ("max_completion_tokens", "max_tokens") if body.get(n) is not None), None)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise BadCall(f"max_tokens must be a positive integer, got {limit!r}")
    try:
        return Sampling(
            **{
                **vars(base),
                "max_new_tokens": min(limit or base.max_new_tokens, left),
                "temperature": number("temperature", base.temperature),
                "top_p": number("top_p", base.top_p),
            }
        )
    except ValueError as exc:
        raise BadCall(str(exc)) from None


def completion(session, text: str, sample, tokenizer, logprobs: bool) -> dict:
    calls = []
    for i, match in enumerate(TOOL_CALL.finditer(text)):
        with contextlib.suppress(ValueError, TypeError, AttributeError):
            call = json.loads(match.group(1))
            calls.append(
                {
                    "id": f"call_{session.index}_{session.trajectory.turns}_{i}",
                    "type": "function",
                    "function": {"name": str(call["name"]), "arguments": json.dumps(call.get("arguments", {}))},
                }
            )
    content = TOOL_CALL.sub("", text).strip() if calls else text
    message = {"role": "assistant", "content": content or None, **({"tool_calls": calls} if calls else {})}
    choice = {
        "index": 0,
        "message": message,
        "finish_reason": "tool_calls" if calls else ("length" if sample.finish_reason == "length" else "stop"),
    }
    if logprobs:
        choice["logprobs"] = {
            "content": [
                {"token": tokenizer.decode([token]), "logprob": lp}
                for token, lp in zip(sample.token_ids, sample.logprobs, strict=True)
            ]
        }
    prompt = len(session.trajectory.prompt_token_ids) + len(session.trajectory.token_ids) - len(sample.token_ids)
    return {
        "id": f"chatcmpl-{session.task_id}-{session.trajectory.turns}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": "steadyrl",
        "choices": [choice],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": len(sample.token_ids),
            "total_tokens": prompt + len(sample.token_ids),
        },
    }
