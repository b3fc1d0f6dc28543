"""A replica's idle time: the seconds since it started during which no task was generating, sent
with each heartbeat (the orchestrator keeps it; the trainer turns it into the replicas' idle share
per step, beside its own)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator


class IdleClock:
    def __init__(self) -> None:
        self.started = self._idle_since = time.monotonic()
        self._idle = 0.0
        self.active = 0

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """While a task generates (several at once count once)."""
        if self.active == 0:
            self._idle += time.monotonic() - self._idle_since
        self.active += 1
        try:
            yield
        finally:
            self.active -= 1
            if self.active == 0:
                self._idle_since = time.monotonic()

    @property
    def idle_seconds(self) -> float:
        return self._idle + (time.monotonic() - self._idle_since if self.active == 0 else 0.0)

    @property
    def uptime_seconds(self) -> float:
        return time.monotonic() - self.started
