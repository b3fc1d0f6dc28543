"""What the trainer trained and has not acknowledged yet, and the checkpoints that let it: a
rollout is acknowledged (XACK, and appended to the `trained` ledger in one script) only once a
checkpoint holding its update and its id is in place (services/trainer/loop.py says why)."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from services.trainer.checkpoint import TrainerState
from services.trainer.model_runner import PendingSave, StepRunner
from services.trainer.stream import RedisRolloutSource

log = logging.getLogger("steadyrl.trainer")
Entries = list[tuple[bytes, str]]  # (stream entry id, rollout id)


class Acknowledgements:
    def __init__(self, runner: StepRunner, source: RedisRolloutSource) -> None:
        self.runner = runner
        self.source = source
        self.unsaved: Entries = []  # trained, in no checkpoint yet
        self.saving: tuple[PendingSave, Entries] | None = None  # a save under way, what it holds
        self.saved: Entries = []  # in the LATEST checkpoint, not yet acknowledged
        self.lock = asyncio.Lock()  # one save, settle or acknowledgement at a time

    def trained(self, entries: Entries) -> None:
        self.unsaved.extend(entries)

    def pending(self) -> Entries:
        """Every trained entry not acknowledged yet."""
        return self.saved + (self.saving[1] if self.saving else []) + self.unsaved

    def save_done(self) -> bool:
        return self.saving is not None and self.saving[0].done()

    async def save(self, state: TrainerState, wait: bool = False) -> Path | None:
        """Start a checkpoint of `state` (the one under way first lands); once it is in place, what
        it holds is acknowledged — now when it blocks or `wait`, else by a later `settle`. Call
        with the trainer's model lock held."""
        async with self.lock:
            if self.saving is not None:
                await self._settle(wait=True)
            pending = await asyncio.to_thread(self.runner.save, state)
            self.saving = (pending, self.unsaved)
            self.unsaved = []
            if wait or pending.done():
                return await self._settle(wait=True)
            return None

    async def settle(self, wait: bool) -> Path | None:
        """The save under way put in place and its rollouts acknowledged (None when not done and
        not `wait`, or when another caller settled it first). A failed save puts its rollouts back
        with the unsaved ones, for the next. It needs no model: it may run while a step does."""
        async with self.lock:
            return await self._settle(wait)

    async def _settle(self, wait: bool) -> Path | None:
        if self.saving is None:  # settled while this caller waited
            return None
        pending, entries = self.saving
        if not wait and not pending.done():
            return None
        started = time.perf_counter()
        try:
            path = await asyncio.to_thread(pending.finish)
        except Exception:
            self.saving = None
            self.unsaved = entries + self.unsaved
            raise
        self.saving = None
        self.saved.extend(entries)
        log.info(
            "event=checkpoint_saved checkpoint=%s step=%d finish_seconds=%.3f",
            path.name if path else "",
            pending.state.step,
            time.perf_counter() - started,
        )
        await self._acknowledge()
        return path

    async def acknowledge(self) -> None:
        """What the checkpoint in place holds, acknowledged (again after a cut-off call)."""
        async with self.lock:
            await self._acknowledge()

    async def _acknowledge(self) -> None:
        await self.source.trained(self.saved)
        self.saved = []
