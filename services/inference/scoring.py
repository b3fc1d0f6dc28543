"""The replica's scoring thread: a group's rewards and encoding run there, off the event loop (a
reward process serves one call at a time, and the loop stays free for Redis and gRPC). Calls made
in the same turn of the loop — the groups an engine step finished together — cross to the thread
and back in one hand-over, not one each (`Scoring.run`)."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable

from shared.runtime.thread_names import name_os_thread

THREAD = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="scoring", initializer=name_os_thread)


class Scoring:
    """`await scoring.run(fn, *args)`: fn(*args) on the scoring thread, its result or its exception
    back; the calls of one loop turn go over in one batch, each with its own outcome."""

    def __init__(self) -> None:
        self.batch: list[tuple[Callable, tuple, asyncio.Future]] = []

    async def run(self, fn: Callable, *args):
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self.batch.append((fn, args, done))
        if len(self.batch) == 1:  # the first of this turn: the batch leaves once the turn's calls are in
            loop.call_soon(self._send, loop)
        return await done

    def _send(self, loop: asyncio.AbstractEventLoop) -> None:
        batch, self.batch = self.batch, []
        outcomes = loop.run_in_executor(THREAD, _run_all, [(fn, args) for fn, args, _ in batch])
        outcomes.add_done_callback(lambda f: _deliver(batch, f))


def _run_all(calls: list[tuple[Callable, tuple]]) -> list[tuple[bool, object]]:
    """Each call's (True, result) or (False, exception), in order: one failing never skips the rest."""
    outcomes = []
    for fn, args in calls:
        try:
            outcomes.append((True, fn(*args)))
        except Exception as exc:  # noqa: BLE001 - carried back to its own caller
            outcomes.append((False, exc))
    return outcomes


def _deliver(batch: list, finished: asyncio.Future) -> None:
    if finished.cancelled() or finished.exception() is not None:  # the executor itself failed: every call
        error = finished.exception() if not finished.cancelled() else asyncio.CancelledError()
        outcomes = [(False, error)] * len(batch)
    else:
        outcomes = finished.result()
    for (_, _, done), (ok, value) in zip(batch, outcomes, strict=True):
        if done.done():  # its caller was cancelled meanwhile
            continue
        if ok:
            done.set_result(value)
        else:
            done.set_exception(value)
