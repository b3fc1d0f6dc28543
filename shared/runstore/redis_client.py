"""The Redis client every service uses: every call bounded in time, retried at most once.

A frozen Redis (a long fsync, a paused VM, SIGSTOP) must surface as an error within a bound, not
a wait forever: each socket read and connect is limited to `timeout` seconds, and only a broken
connection is retried (once, on a new connection); a timeout is never retried, because the command
may have been applied and the caller decides what a repeat means.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError


class RedisSettings(BaseSettings):
    """The Redis connection fields of a service's settings (declared once, inherited)."""

    redis_url: SecretStr = SecretStr("redis://127.0.0.1:6379/0")
    """Redis of the run (may carry a password, URL-escaped; never logged)."""
    redis_password_file: Path | None = None
    """A file holding Redis's password (a mounted Secret): used as is, no escaping, when the URL
    carries none."""
    redis_timeout_seconds: float = Field(5.0, gt=0, le=300)
    """Bound on each Redis call (socket read and connect); a longer one fails and is recovered."""

    @field_validator("redis_url")
    @classmethod
    def _a_redis_url(cls, url: SecretStr) -> SecretStr:
        """Parsed as the client will parse it, when the settings are read (not at the first call); the
        message never repeats the URL, which may carry a password."""
        from redis.connection import parse_url

        try:
            parse_url(url.get_secret_value())
        except ValueError:
            raise ValueError(
                "redis_url is not a Redis URL: redis://[[user]:password@]host[:port][/db], rediss://… or "
                "unix://path (a numeric port)"
            ) from None
        return url

    def redis(self) -> Redis:
        from shared.rpc.secret_files import read_secret

        password = None
        if self.redis_password_file is not None:  # deploy/env.example's placeholder refused
            password = read_secret(self.redis_password_file, "Redis's password, redis_password_file")
        return connect(self.redis_url.get_secret_value(), self.redis_timeout_seconds, password)


def connect(url: str, timeout: float = 5.0, password: str | None = None) -> Redis:
    """An asyncio client whose calls fail after `timeout` seconds of silence from the server;
    `password` is used where the URL carries none."""
    from urllib.parse import urlsplit

    extra = {"password": password} if password and not urlsplit(url).password else {}
    return Redis.from_url(
        url,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        health_check_interval=10,
        retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), 1, supported_errors=(RedisConnectionError,)),
        **extra,
    )
