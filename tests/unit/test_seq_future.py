"""The torch engine's light sequence future behaves as a concurrent.futures.Future where the engine,
asyncio.wrap_future and the replica's gathering use one."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import pytest

from shared.engines.base import gathered
from shared.engines.seq_future import SeqFuture


def test_result_exception_and_callbacks():
    f = SeqFuture()
    seen = []
    f.add_done_callback(lambda x: seen.append(("before", x.result())))
    assert not f.done() and not f.running()
    with pytest.raises(TimeoutError):
        f.result(timeout=0)
    assert f.set_running_or_notify_cancel() and f.running()
    assert not f.cancel()  # running: not cancelled, but the engine aborts it at its next step
    assert f.aborted
    f.set_result(7)
    f.add_done_callback(lambda x: seen.append(("after", x.result())))
    assert f.done() and f.result() == 7 and f.exception() is None
    assert seen == [("before", 7), ("after", 7)]
    with pytest.raises(concurrent.futures.InvalidStateError):
        f.set_result(8)
    g = SeqFuture()
    g.set_exception(ValueError("bad token"))
    with pytest.raises(ValueError, match="bad token"):
        g.result()
    assert isinstance(g.exception(), ValueError)


def test_cancel_before_it_runs():
    f = SeqFuture()
    called = []
    f.add_done_callback(called.append)
    assert f.cancel() and f.cancelled() and f.done() and called == [f]
    assert not f.set_running_or_notify_cancel()
    with pytest.raises(concurrent.futures.CancelledError):
        f.result()


def test_a_waiting_thread_wakes_when_it_is_set():
    f = SeqFuture()
    got = []
    waiter = threading.Thread(target=lambda: got.append(f.result(timeout=30)))
    waiter.start()
    f.set_running_or_notify_cancel()
    f.set_result("sample")
    waiter.join(30)
    assert got == ["sample"] and not waiter.is_alive()


def test_asyncio_and_the_replicas_gathering_take_it():
    async def main():
        one, many = SeqFuture(), [SeqFuture() for _ in range(3)]
        wrapped = asyncio.wrap_future(one)
        group = gathered(many)

        def engine():  # the engine thread settles them
            for i, f in enumerate([one, *many]):
                f.set_running_or_notify_cancel()
                f.set_result(i)

        threading.Thread(target=engine).start()
        return await asyncio.wait_for(wrapped, 30), await asyncio.wait_for(group, 30)

    assert asyncio.run(main()) == (0, [1, 2, 3])
