"""A sequence's future, light enough to make 256 of each engine step: a `concurrent.futures.Future`
(asyncio.wrap_future accepts it) without the condition variable and reentrant lock each one builds.
Every SeqFuture's state changes under one module lock, held for a few attribute reads and writes; a
thread that waits on one pending future gets an Event of its own. Not for `concurrent.futures.wait`
or `as_completed` (they reach into the base class's condition). docs/internals/engines.md"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from concurrent.futures._base import CANCELLED, CANCELLED_AND_NOTIFIED, FINISHED, PENDING, RUNNING

log = logging.getLogger(__name__)

_STATE = threading.Lock()  # every SeqFuture's state: never held while a callback runs or a thread waits
_ENDED = (CANCELLED, CANCELLED_AND_NOTIFIED, FINISHED)


class SeqFuture(concurrent.futures.Future):
    """A sequence's future; cancelling it while it runs aborts the sequence at the next step."""

    aborted = False

    def __init__(self) -> None:  # the base's __init__ builds a Condition(RLock()): not called
        self._state = PENDING
        self._result = None
        self._exception = None
        self._done_callbacks = []
        self._event: threading.Event | None = None

    def __repr__(self) -> str:
        return f"<SeqFuture at {id(self):#x} state={self._state}>"

    def cancel(self) -> bool:
        self.aborted = True
        with _STATE:
            if self._state in (RUNNING, FINISHED):
                return False
            if self._state in (CANCELLED, CANCELLED_AND_NOTIFIED):
                return True
            self._state = CANCELLED
        self._ended()
        return True

    def cancelled(self) -> bool:
        return self._state in (CANCELLED, CANCELLED_AND_NOTIFIED)

    def running(self) -> bool:
        return self._state == RUNNING

    def done(self) -> bool:
        return self._state in _ENDED

    def set_running_or_notify_cancel(self) -> bool:
        with _STATE:
            if self._state == CANCELLED:
                self._state = CANCELLED_AND_NOTIFIED
                return False
            if self._state == PENDING:
                self._state = RUNNING
                return True
        raise RuntimeError(f"Future in unexpected state: {self._state}")

    def set_result(self, result) -> None:
        self._settle(result, None)

    def set_exception(self, exception) -> None:
        self._settle(None, exception)

    def _settle(self, result, exception) -> None:
        with _STATE:
            if self._state in _ENDED:
                raise concurrent.futures.InvalidStateError(f"{self._state}: {self!r}")
            self._result, self._exception = result, exception
            self._state = FINISHED
        self._ended()

    def _ended(self) -> None:
        with _STATE:
            event = self._event
        if event is not None:
            event.set()
        self._invoke_callbacks()

    def add_done_callback(self, fn) -> None:
        with _STATE:
            if self._state not in _ENDED:
                self._done_callbacks.append(fn)
                return
        try:
            fn(self)
        except Exception:  # noqa: BLE001 - as the base class: a callback's failure is logged
            log.exception("exception calling callback for %r", self)

    def _wait(self, timeout: float | None) -> None:
        with _STATE:
            if self._state in _ENDED or timeout == 0:
                return
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        event.wait(timeout)

    def _finished(self, timeout: float | None) -> None:
        """Wait up to `timeout` for the end; raise unless it ended with a result or an exception."""
        self._wait(timeout)
        if self.cancelled():
            raise concurrent.futures.CancelledError()
        if self._state != FINISHED:
            raise TimeoutError()

    def result(self, timeout: float | None = None):
        self._finished(timeout)
        if self._exception is not None:
            raise self._exception
        return self._result

    def exception(self, timeout: float | None = None):
        self._finished(timeout)
        return self._exception
