"""PoolClient's turn-taking, without a network: concurrent calls each try every replica before any twice,
so one dead replica among two never fails a call of two attempts, however the calls interleave."""

import asyncio

import grpc

from shared.rpc.pool_client import PoolClient


class Replica:
    def __init__(self, alive: bool) -> None:
        self.alive = alive
        self.calls = 0

    async def Score(self, request, timeout):  # noqa: N802 - the RPC's name
        self.calls += 1
        await asyncio.sleep(0.001 * (request % 3))  # calls interleave
        if not self.alive:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "down")
        return request


def test_concurrent_calls_each_reach_the_live_replica():
    replicas = [Replica(alive=False), Replica(alive=True)]

    async def main():
        stubs = iter(replicas)
        client = PoolClient(
            "teacher", ["dead:1", "live:2"], lambda channel: next(stubs), 1.0, 2, 0.0, channel=lambda address: None
        )
        return await asyncio.gather(*(client.call("Score", i) for i in range(40)))

    assert asyncio.run(main()) == list(range(40))
    assert replicas[1].calls == 40 and replicas[0].calls == 20  # half start on the dead one, then go on to the live one
