"""A service loop that dies is never silent: it is logged, health turns NOT_SERVING, the service
stops with an error; a finishing loop stops it cleanly."""

import asyncio
import logging

import pytest
from grpc_health.v1 import health, health_pb2

from shared.runtime.service_main import LoopDied, run_loops


async def status(servicer) -> int:
    return (await servicer.Check(health_pb2.HealthCheckRequest(service=""), None)).status


def test_a_dying_loop_is_logged_and_turns_the_service_not_serving(caplog):
    async def main():
        servicer = health.aio.HealthServicer()
        await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        serving = await status(servicer)
        stop = asyncio.Event()

        async def dies():
            await asyncio.sleep(0.05)
            raise KeyError("a bug in the loop")

        async def forever():
            await asyncio.Event().wait()

        with pytest.raises(LoopDied, match="loop rollouts failed: KeyError"):
            await run_loops({"rollouts": dies(), "heartbeat": forever()}, stop, servicer)
        return serving, await status(servicer)

    with caplog.at_level(logging.ERROR, logger="steadyrl.service"):
        serving, after = asyncio.run(asyncio.wait_for(main(), 10))
    assert serving == health_pb2.HealthCheckResponse.SERVING
    assert after == health_pb2.HealthCheckResponse.NOT_SERVING
    assert any("event=loop_died loop=rollouts" in r.getMessage() for r in caplog.records)


def test_a_loop_that_returns_early_dies_unless_it_finishes_the_work():
    async def main():
        stop = asyncio.Event()

        async def quits():
            return None

        with pytest.raises(LoopDied, match="loop heartbeat returned"):
            await run_loops({"heartbeat": quits()}, stop)
        await run_loops({"trainer": quits()}, stop, finishing=frozenset({"trainer"}))  # done: a clean stop
        stop.set()
        await run_loops({"heartbeat": quits()}, stop)  # returned because asked to stop

    asyncio.run(asyncio.wait_for(main(), 10))


def test_a_replica_hands_back_its_leases_even_when_its_stop_cancels_it_meanwhile():
    """The service's stop cancels the rollout loop while it is handing its leases back: the hand-
    back still finishes, and the cancellation is raised after it, not swallowed."""
    import asyncio

    from shared.runtime.service_main import finish_despite_cancellation

    handed_back: list[str] = []

    async def shutdown():
        for task_id in ("a", "b", "c"):
            await asyncio.sleep(0.05)  # a Redis call each
            handed_back.append(task_id)

    async def loop():
        try:
            await asyncio.sleep(10)
        finally:
            await finish_despite_cancellation(shutdown())

    async def main():
        task = asyncio.create_task(loop())
        await asyncio.sleep(0.01)
        task.cancel()  # the stop
        await asyncio.sleep(0.06)
        task.cancel()  # run_loops cancelling again, mid hand-back
        try:
            await task
        except asyncio.CancelledError:
            return "cancelled"
        return "finished"

    assert asyncio.run(main()) == "cancelled" and handed_back == ["a", "b", "c"]
