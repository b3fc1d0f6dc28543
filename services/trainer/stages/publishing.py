"""The publishing stage: a version staged on its step's path (what reads the weights: with shm its file written),
the rest (the announcement to weight-sync, old files pruned) as a task of its own while the next step trains, in
order; a version that failed published again, and weight-sync asked whether it still holds the last one."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

from services.trainer.checkpoint import TrainerState
from services.trainer.model_runner import StepRunner
from services.trainer.version_publisher import VersionPublisher


class Publishing:
    def __init__(
        self, publisher: VersionPublisher, runner: StepRunner, state: TrainerState, model_lock: asyncio.Lock
    ) -> None:
        self.publisher = publisher
        self.runner = runner
        self.state = state
        self.model_lock = model_lock
        self.announcing: asyncio.Task | None = None  # the version on its way out
        self.next_publish = time.monotonic()  # a failed version is published again from then on
        self.next_held_check = self.next_publish  # weight-sync asked again from then on
        self.reported = self.progress()  # what Status says: as of the last version out

    def progress(self) -> tuple[int, int, int]:
        """(step, version, rollouts trained) as of the last published version (what Status says)."""
        return self.state.step, min(self.state.version, self.publisher.published), len(self.state.consumed)

    async def resume(self) -> None:
        """Continue the version numbering past anything already published."""
        self.state.version = await self.publisher.resume(self.state.version)

    async def publish(self) -> None:
        """Publish the current weights as the current version (call with the model lock held): what
        reads the weights now, the rest (shm: the announcement) in the background (`announcing`),
        after the previous version's, while the next step runs. On failure `retry` tries again, two
        seconds later at the earliest."""
        await self.announced()
        weights = self.runner.weights() if self.publisher.enabled else {}
        staged = self.state.step, self.state.version, len(self.state.consumed)  # Status, once it is out
        complete = await self.publisher.stage(weights, self.state.version)
        self.announcing = asyncio.ensure_future(self._announce(complete, staged))

    async def _announce(self, complete: Callable[[], Awaitable[bool]], staged: tuple[int, int, int]) -> None:
        if not await complete():
            self.next_publish = time.monotonic() + 2.0
            await asyncio.sleep(0.5)
        step, version, trained = staged
        self.reported = step, min(version, self.publisher.published), trained

    async def announced(self) -> None:
        """The version on its way out is out (or failed: `retry` publishes it again)."""
        if self.announcing is not None:
            try:
                await asyncio.shield(self.announcing)  # a cancelled waiter leaves it to finish
            finally:
                if self.announcing is not None and self.announcing.done():
                    self.announcing = None

    async def reap(self) -> None:
        """The announcement that ended forgotten (its error raised)."""
        if self.announcing is not None and self.announcing.done():
            await self.announced()

    async def retry(self) -> None:
        """Weight-sync asked (every 3 s, never while a version is on its way out: its latest may be the one before)
        whether it still holds the last version; a version not out published again, under the model lock."""
        if self.publisher.enabled and self.announcing is None and time.monotonic() >= self.next_held_check:
            self.next_held_check = time.monotonic() + 3.0
            await self.publisher.held_by_weightsync()
        if (
            self.announcing is None
            and self.publisher.published < self.state.version
            and time.monotonic() >= self.next_publish
        ):
            async with self.model_lock:
                await self.publish()

    async def finish(self, stop: asyncio.Event) -> None:
        """The run's end: the version on its way out waited for, one not out published again until it is (while
        no stop is asked for)."""
        await self.announced()
        while self.publisher.published < self.state.version and not stop.is_set():
            await self.publish()
            await self.announced()

    async def close(self, timeout: float) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.announced(), timeout)
