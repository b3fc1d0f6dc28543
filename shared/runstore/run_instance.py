"""The run's instance: 32 random hexadecimal characters, made once by the first service of a run
that asks (SET NX) and read by every other. It is signed into every version's manifest, so that a
version of an earlier run — signed with the same key, as a deployment keeps one pair — is refused
in this one; it lives in the run's Redis, so it survives restarts of the services and a new run
(new Redis state) gets a new one (docs/security.md)."""

from __future__ import annotations

import asyncio
import logging
import secrets

from redis.asyncio import Redis
from redis.exceptions import RedisError

from shared.runstore.keys import RunKeys

log = logging.getLogger("steadyrl.runstore")
INSTANCE_CHARS = 32


def valid_instance(text: str) -> bool:
    """Whether `text` is an instance id (32 lower-case hexadecimal characters)."""
    return len(text) == INSTANCE_CHARS and all(c in "0123456789abcdef" for c in text)


async def run_instance(client: Redis, run_id: str, wait_seconds: float = 120.0) -> str:
    """The run's instance id, made here when no service made it yet; retried while Redis starts,
    at most `wait_seconds` (then the last RedisError)."""
    key = RunKeys(run_id).instance
    clock = asyncio.get_running_loop().time
    deadline = clock() + wait_seconds
    delay = 0.2
    while True:
        try:
            await client.set(key, secrets.token_hex(INSTANCE_CHARS // 2), nx=True)
            value = await client.get(key)
            break
        except RedisError as exc:
            if clock() + delay > deadline:
                raise
            log.warning(
                "event=redis_unreachable reading=run_instance error=%s retry_in=%.1fs", type(exc).__name__, delay
            )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
    text = value.decode() if isinstance(value, bytes) else str(value)
    if not valid_instance(text):
        raise ValueError(f"the run's instance in Redis ({key}) is not {INSTANCE_CHARS} hexadecimal characters")
    return text


async def resolve_instance(settings, client: Redis | None) -> str:
    """A service's instance: its `run_instance` setting when given, else the run's in Redis; empty
    for unsigned weights (nothing is signed or verified then) or without a Redis."""
    if settings.run_instance or settings.unsigned_weights or client is None:
        return settings.run_instance
    return await run_instance(client, settings.run_id)
