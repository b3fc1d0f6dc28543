"""What the control plane (HTTP and gRPC) asks of Redis, each request bounded in time.

Within `control.timeout_seconds` a request has Redis's answer or gets `RedisUnavailable` (HTTP 503 with `Retry-After`,
gRPC `UNAVAILABLE`); `GET /v1/run` answers the last status read instead, marked `stale`. A transition answered 503 was
not applied: its script carries a deadline in Redis's clock, and the request waits one second past it.

Details: docs/internals/orchestrator.md"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable
from typing import TypeVar

import redis.exceptions

from shared.runstore.queues import now_ms

T = TypeVar("T")
REPLY_MARGIN_SECONDS = 1.0  # how much longer a request waits than its script's deadline


class RedisUnavailable(RuntimeError):
    """Redis did not answer within the control plane's bound (nothing was applied)."""

    def __init__(self, what: str, reason: str, retry_after: int) -> None:
        super().__init__(f"{what}: Redis did not answer ({reason}); nothing was applied, try again")
        self.reason = reason
        self.retry_after = retry_after


def reason_of(exc: BaseException) -> str:
    return type(exc).__name__ if isinstance(exc, TimeoutError | redis.exceptions.RedisError) else repr(exc)


class Bounded:
    """Runs the control plane's Redis work within `timeout` seconds and keeps the last status."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.retry_after = max(1, math.ceil(2 * timeout))
        self.clock_offset_ms = 0  # Redis's clock minus ours (measured by `measure_clock`)
        self.last_status: dict | None = None
        self.last_status_ms = 0

    def deadline_ms(self) -> int:
        """The deadline of a script sent now, in Redis's clock."""
        return now_ms() + self.clock_offset_ms + int(self.timeout * 1000)

    async def call(self, what: str, work: Awaitable[T], margin: float = 0.0) -> T:
        """`work` within the bound (plus `margin`), else RedisUnavailable."""
        try:
            async with asyncio.timeout(self.timeout + margin):
                return await work
        except (TimeoutError, redis.exceptions.RedisError) as exc:
            raise RedisUnavailable(what, reason_of(exc), self.retry_after) from None

    async def status(self, read: Awaitable[dict]) -> dict:
        """The live status; when Redis does not answer in time, the last one read, marked `stale`."""
        try:
            return self.keep(await self.call("status", read))
        except RedisUnavailable as exc:
            if self.last_status is None:
                raise
            return {
                **self.last_status,
                "stale": {
                    "read_unix_ms": self.last_status_ms,
                    "reason": exc.reason,
                    "age_seconds": round((now_ms() - self.last_status_ms) / 1000, 1),
                },
            }

    def keep(self, status: dict) -> dict:
        self.last_status = status
        self.last_status_ms = now_ms()
        return status

    async def measure_clock(self, client) -> None:
        """Redis's clock against ours (half the round trip taken as the reply's delay)."""
        before = now_ms()
        seconds, micros = await client.time()
        after = now_ms()
        self.clock_offset_ms = seconds * 1000 + micros // 1000 - (before + after) // 2
