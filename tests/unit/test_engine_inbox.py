"""The engine's hand-over to the event loop (`shared.engines.base.gathered`): every group an engine
step finishes settles, with one wake-up of the loop for all of them, and none is stranded when
another's callback fails."""

import asyncio
import concurrent.futures
import threading

from shared.engines.base import _Inbox, gathered


def test_groups_done_together_wake_the_loop_once_and_all_settle():
    async def main():
        loop = asyncio.get_running_loop()
        wakeups = []
        original = loop.call_soon_threadsafe

        def counted(callback, *args, **kwargs):
            wakeups.append(callback)
            return original(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counted
        groups = [[concurrent.futures.Future() for _ in range(8)] for _ in range(32)]
        waiting = [gathered(g) for g in groups]

        def engine_step() -> None:  # one step finishes every sample of every group
            for g, futures in enumerate(groups):
                for i, future in enumerate(futures):
                    future.set_result((g, i))

        thread = threading.Thread(target=engine_step)
        thread.start()
        results = await asyncio.wait_for(asyncio.gather(*waiting), 10)
        thread.join()
        return results, len(wakeups)

    results, wakeups = asyncio.run(main())
    assert results == [[(g, i) for i in range(8)] for g in range(32)]
    assert 1 <= wakeups <= 3  # the first group's write wakes the loop; the others join it (32 before)


def test_a_failing_callback_strands_none_of_the_others():
    async def main():
        loop = asyncio.get_running_loop()
        seen, errors = [], []
        loop.set_exception_handler(lambda _, context: errors.append(context["exception"]))
        inbox = _Inbox(loop)

        def post_all() -> None:
            inbox.post(lambda: seen.append(1))
            inbox.post(lambda: 1 / 0)
            inbox.post(lambda: seen.append(3))

        thread = threading.Thread(target=post_all)
        thread.start()
        thread.join()
        for _ in range(5):
            await asyncio.sleep(0)
        return seen, errors

    seen, errors = asyncio.run(main())
    assert seen == [1, 3] and len(errors) == 1 and isinstance(errors[0], ZeroDivisionError)


def test_a_failed_or_cancelled_sample_fails_or_cancels_its_group():
    async def main():
        failed, cancelled = [concurrent.futures.Future() for _ in range(2)], [concurrent.futures.Future()]
        groups = gathered(failed), gathered(cancelled)
        failed[0].set_result("ok")
        failed[1].set_exception(ValueError("sample 1"))
        cancelled[0].cancel()
        done = await asyncio.gather(*groups, return_exceptions=True)
        return done

    first, second = asyncio.run(main())
    assert isinstance(first, ValueError) and str(first) == "sample 1"
    assert isinstance(second, asyncio.CancelledError)
