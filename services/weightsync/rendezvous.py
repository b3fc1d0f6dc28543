"""The rendezvous of collective epochs, held by the weight-sync service itself and reached through
its authenticated RPCs (`RendezvousPut` / `RendezvousWait` / `RendezvousAdd`, the deployment's
token required): no store port of its own for anyone to reach. Each epoch gets a key space named
by a random token, which its members learn only from their announcement on the authenticated
Watch stream; the newest two epochs' spaces are kept, each bounded in keys and bytes. A wait is
bounded by the service's collective timeout whatever the caller asks."""

from __future__ import annotations

import asyncio
import secrets
import threading
import time

MAX_KEYS = 4096
MAX_KEY_BYTES = 256
MAX_VALUE_BYTES = 1 << 16
KEPT = 2  # the current epoch's space and the one before (a member still leaving it)


class RendezvousError(ValueError):
    """A key space that is not open (unknown epoch, wrong name), or past its bounds."""


class Rendezvous:
    """Every open epoch's key space; safe from the event loop and from threads (rank 1's group)."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._spaces: dict[int, tuple[str, dict[str, bytes]]] = {}
        self._changed = threading.Condition()

    def open(self, epoch: int) -> str:
        """The name of `epoch`'s key space (made on first use; older epochs past KEPT dropped)."""
        with self._changed:
            if epoch not in self._spaces:
                self._spaces[epoch] = (secrets.token_urlsafe(24), {})
                for old in sorted(self._spaces)[:-KEPT]:
                    del self._spaces[old]
            return self._spaces[epoch][0]

    def _space(self, epoch: int, name: str) -> dict[str, bytes]:
        space = self._spaces.get(epoch)
        if space is None or not secrets.compare_digest(space[0], name):
            raise RendezvousError(f"no rendezvous open for epoch {epoch} under that name")
        return space[1]

    def put(self, epoch: int, name: str, key: str, value: bytes) -> None:
        if len(key.encode()) > MAX_KEY_BYTES or len(value) > MAX_VALUE_BYTES:
            raise RendezvousError(f"a key is at most {MAX_KEY_BYTES} bytes, a value {MAX_VALUE_BYTES}")
        with self._changed:
            space = self._space(epoch, name)
            if key not in space and len(space) >= MAX_KEYS:
                raise RendezvousError(f"epoch {epoch}'s rendezvous holds {MAX_KEYS} keys already")
            space[key] = bytes(value)
            self._changed.notify_all()

    def add(self, epoch: int, name: str, key: str, amount: int) -> int:
        with self._changed:
            space = self._space(epoch, name)
            try:
                total = int(space.get(key, b"0")) + amount
            except ValueError:
                raise RendezvousError(f"key {key!r} holds no integer") from None
        self.put(epoch, name, key, str(total).encode())
        return total

    def _get(self, epoch: int, name: str, key: str) -> bytes | None:
        return self._space(epoch, name).get(key)

    def wait(self, epoch: int, name: str, key: str, timeout: float) -> bytes:
        """The key's value once set (TimeoutError past min(timeout, the service's bound))."""
        deadline = time.monotonic() + min(timeout, self.timeout)
        with self._changed:
            while (value := self._get(epoch, name, key)) is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"rendezvous key {key!r} of epoch {epoch} not set in time")
                self._changed.wait(left)
            return value

    async def wait_async(self, epoch: int, name: str, key: str, timeout: float) -> bytes:
        """`wait` without holding a thread: polled every 10 ms on the event loop."""
        deadline = time.monotonic() + min(timeout, self.timeout)
        while True:
            with self._changed:
                value = self._get(epoch, name, key)
            if value is not None:
                return value
            if time.monotonic() >= deadline:
                raise TimeoutError(f"rendezvous key {key!r} of epoch {epoch} not set in time")
            await asyncio.sleep(0.01)
