"""A service loop that dies is never silent: it is logged, health turns NOT_SERVING, the service
stops with an error; a finishing loop stops it cleanly."""

import asyncio
import logging

import pytest
from grpc_health.v1 import health, health_pb2

from shared.service_main import LoopDied, run_loops


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
