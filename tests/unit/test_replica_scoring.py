"""The replica's scoring thread (`services.inference.scoring.Scoring`): the calls of one loop turn go
to the thread in one batch, each gets its own result or exception, a cancelled caller is skipped."""

import asyncio
import threading

import pytest

from services.inference.scoring import Scoring


def test_one_turn_s_calls_cross_in_one_batch_each_with_its_outcome():
    threads, batches = set(), []

    def score(group: int) -> int:
        threads.add(threading.current_thread().name)
        if group == 2:
            raise ValueError("group 2 scored too few")
        return group * 10

    async def main():
        scoring = Scoring()
        original = scoring._send

        def counted(loop):
            batches.append(len(scoring.batch))
            original(loop)

        scoring._send = counted
        first = await asyncio.gather(*(scoring.run(score, g) for g in range(5)), return_exceptions=True)
        later = await scoring.run(score, 7)  # a later turn: a batch of its own
        return first, later

    first, later = asyncio.run(main())
    assert first[:2] == [0, 10] and first[3:] == [30, 40] and later == 70
    assert isinstance(first[2], ValueError) and str(first[2]) == "group 2 scored too few"
    assert batches == [5, 1] and len(threads) == 1 and threads.pop().startswith("scoring")


def test_a_cancelled_caller_is_skipped_and_the_others_get_theirs():
    started = threading.Event()
    release = threading.Event()

    def slow(value: int) -> int:
        started.set()
        release.wait(5)
        return value

    async def main():
        scoring = Scoring()
        kept = asyncio.ensure_future(scoring.run(slow, 1))
        dropped = asyncio.ensure_future(scoring.run(slow, 2))
        await asyncio.sleep(0)
        await asyncio.to_thread(started.wait, 5)
        dropped.cancel()
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await dropped
        return await kept

    assert asyncio.run(main()) == 1
