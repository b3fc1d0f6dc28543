"""The rendezvous key spaces weight-sync holds behind its authenticated RPCs (`RendezvousPut` /
`RendezvousWait` / `RendezvousAdd`, the token required): no store port of its own, and nothing
decodes a value here but an add's decimal integer.

- A collective epoch's space is named by a random token its members learn only from their
  announcement on the Watch stream; the newest two epochs' are kept.
- A trainer job's (`job`: torchrun's rendezvous id): round 0 holds its counters, each later
  round its nodes and their ranks' process-group store; the newest rounds of two jobs are kept.

Every space is bounded in keys and bytes; an add is atomic, in int64 as torch's stores count; a
wait is bounded by the service's timeout (a NaN or negative one refused)."""

from __future__ import annotations

import asyncio
import math
import re
import secrets
import threading
import time
from dataclasses import dataclass, field

MAX_KEY_BYTES = 256
MAX_VALUE_BYTES = 1 << 16
KEPT = 2  # the current epoch's space and the one before (a member still leaving it)
JOBS_KEPT = 2  # trainer jobs (a new job instance, e.g. a requeued one, drops the oldest)
ROUNDS_KEPT = 3  # a job's newest rounds, besides its round 0
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
DECIMAL = re.compile(rb"-?[0-9]{1,19}")


class RendezvousError(ValueError):
    """A key space that is not open (unknown epoch, wrong name, a round not open), or past its bounds."""


class RendezvousRequestError(ValueError):
    """A request no key space could take: a NaN or negative wait, an amount that is no int64."""


@dataclass
class Space:
    """One key space, bounded in keys and in bytes (keys and values together)."""

    max_keys: int
    max_bytes: int
    keys: dict[str, bytes] = field(default_factory=dict)
    nbytes: int = 0

    def put(self, key: str, value: bytes) -> None:
        size = len(key.encode()) + len(value)
        old = self.keys.get(key)
        grown = size - (len(key.encode()) + len(old) if old is not None else 0)
        if old is None and len(self.keys) >= self.max_keys:
            raise RendezvousError(f"the rendezvous holds {self.max_keys} keys already")
        if self.nbytes + grown > self.max_bytes:
            raise RendezvousError(f"the rendezvous holds {self.max_bytes} bytes at most")
        self.keys[key] = value
        self.nbytes += grown


def epoch_space() -> Space:
    return Space(max_keys=4096, max_bytes=16 << 20)


def round_space() -> Space:
    """A trainer round: its nodes' keys and every rank's process-group keys (gloo's addresses)."""
    return Space(max_keys=16384, max_bytes=32 << 20)


def parse_amount(value: bytes) -> int:
    """An add's amount from the wire: a decimal int64 ("" is 0), nothing looser (no spaces, "_", "1e3")."""
    if not value:
        return 0
    if not DECIMAL.fullmatch(value) or not INT64_MIN <= int(value) <= INT64_MAX:
        raise RendezvousRequestError(f"an add's amount is a decimal int64, not {value[:32]!r}")
    return int(value)


class Rendezvous:
    """Every open key space; safe from the event loop and from threads (rank 1's group)."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._spaces: dict[int, tuple[str, Space]] = {}
        self._jobs: dict[str, dict[int, Space]] = {}  # job → round → space, the least recently used first
        self._changed = threading.Condition()

    def open(self, epoch: int) -> str:
        """The name of `epoch`'s key space (made on first use; older epochs past KEPT dropped)."""
        with self._changed:
            if epoch not in self._spaces:
                self._spaces[epoch] = (secrets.token_urlsafe(24), epoch_space())
                for old in sorted(self._spaces)[:-KEPT]:
                    del self._spaces[old]
            return self._spaces[epoch][0]

    def _space(self, epoch: int, name: str, job: str = "") -> Space:
        if job:
            return self._round(job, epoch)
        space = self._spaces.get(epoch)
        if space is None or not secrets.compare_digest(space[0], name):
            raise RendezvousError(f"no rendezvous open for epoch {epoch} under that name")
        return space[1]

    def _round(self, job: str, number: int) -> Space:
        """Round `number` of `job`: its round 0, a round kept, or the next one, opened now."""
        if len(job.encode()) > MAX_KEY_BYTES:
            raise RendezvousError(f"a job's name is at most {MAX_KEY_BYTES} bytes")
        rounds = self._jobs.pop(job, None)
        if rounds is None:
            rounds = {0: round_space()}
            while len(self._jobs) >= JOBS_KEPT:
                del self._jobs[next(iter(self._jobs))]
        self._jobs[job] = rounds
        if number not in rounds:
            newest = max(rounds)
            if number != newest + 1:
                raise RendezvousError(f"round {number} of job {job!r} is not open (its newest is {newest})")
            rounds[number] = round_space()
            for old in sorted(rounds)[1:-ROUNDS_KEPT]:
                del rounds[old]
        return rounds[number]

    def put(self, epoch: int, name: str, key: str, value: bytes, job: str = "") -> None:
        if len(key.encode()) > MAX_KEY_BYTES or len(value) > MAX_VALUE_BYTES:
            raise RendezvousError(f"a key is at most {MAX_KEY_BYTES} bytes, a value {MAX_VALUE_BYTES}")
        with self._changed:
            self._space(epoch, name, job).put(key, bytes(value))
            self._changed.notify_all()

    def add(self, epoch: int, name: str, key: str, amount: int, job: str = "") -> int:
        """The key's integer plus `amount`, in one step (no add is lost to another)."""
        if len(key.encode()) > MAX_KEY_BYTES:
            raise RendezvousError(f"a key is at most {MAX_KEY_BYTES} bytes")
        if not INT64_MIN <= amount <= INT64_MAX:
            raise RendezvousRequestError("an add's amount is an int64")
        with self._changed:
            space = self._space(epoch, name, job)
            held = space.keys.get(key, b"0")
            if not DECIMAL.fullmatch(held):
                raise RendezvousRequestError(f"key {key!r} holds no integer")
            total = int(held) + amount
            if not INT64_MIN <= total <= INT64_MAX:
                raise RendezvousRequestError(f"key {key!r} would pass int64")
            space.put(key, str(total).encode())
            self._changed.notify_all()
        return total

    def _get(self, epoch: int, name: str, key: str, job: str = "") -> bytes | None:
        return self._space(epoch, name, job).keys.get(key)

    def held(self, job: str) -> dict[int, dict[str, bytes]]:
        """What `job`'s rounds hold now, by round (a copy; empty for a job not kept)."""
        with self._changed:
            return {number: dict(space.keys) for number, space in self._jobs.get(job, {}).items()}

    def bound(self, timeout: float) -> float:
        """How long a wait that asks for `timeout` seconds lasts: at most the service's bound."""
        if math.isnan(timeout) or timeout < 0:
            raise RendezvousRequestError(f"timeout_seconds must be a number >= 0, not {timeout}")
        return min(timeout, self.timeout)

    def wait(self, epoch: int, name: str, key: str, timeout: float, job: str = "") -> bytes:
        """The key's value once set (TimeoutError past min(timeout, the service's bound))."""
        deadline = time.monotonic() + self.bound(timeout)
        with self._changed:
            while (value := self._get(epoch, name, key, job)) is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"rendezvous key {key!r} of epoch {epoch} not set in time")
                self._changed.wait(left)
            return value

    async def wait_async(self, epoch: int, name: str, key: str, timeout: float, job: str = "") -> bytes:
        """`wait` without holding a thread: polled every 10 ms on the event loop."""
        deadline = time.monotonic() + self.bound(timeout)
        while True:
            with self._changed:
                value = self._get(epoch, name, key, job)
            if value is not None:
                return value
            if time.monotonic() >= deadline:
                raise TimeoutError(f"rendezvous key {key!r} of epoch {epoch} not set in time")
            await asyncio.sleep(0.01)
