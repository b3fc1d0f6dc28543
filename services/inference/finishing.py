"""The tasks a replica is finishing: their samples are back from the engine, their rewards and
encoding under way, not yet handed to the sender. Groups that leave the engine together finish
within a few milliseconds of each other; the sender and the leasing loop wait for that burst to
settle (at most `SETTLE_SECONDS`), so that its tasks are sent in one Redis call and their places
leased in one, not one call per task (docs/internals/inference.md#one-call-per-burst)."""

from __future__ import annotations

import asyncio
import contextlib

SETTLE_SECONDS = 0.02  # the longest a send or a lease waits for a burst to settle


class Finishing:
    def __init__(self) -> None:
        self.tasks: set[str] = set()
        self.quiet = asyncio.Event()
        self.quiet.set()

    def begin(self, task_id: str) -> None:
        self.tasks.add(task_id)
        self.quiet.clear()

    def end(self, task_id: str) -> None:
        self.tasks.discard(task_id)
        if not self.tasks:
            self.quiet.set()

    async def settled(self, bound: float = SETTLE_SECONDS) -> None:
        """Until no task is finishing, or `bound` seconds."""
        if not self.quiet.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.quiet.wait(), bound)
