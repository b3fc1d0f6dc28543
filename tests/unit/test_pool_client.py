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


def test_waiting_for_a_pool_ends_when_a_replica_listens_and_is_bounded_when_none_does():
    """wait_ready against real channels: nothing listens on the first address; a gRPC server starts
    on the second 1.5 s in, and the wait ends then. With no server at all, it raises PoolError at its
    bound, naming the addresses."""
    import socket

    from shared.rpc.pool_client import PoolError

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    nobody, later = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"

    async def main():
        client = PoolClient("judge", [nobody, later], lambda channel: None, 1.0, 1, ready_seconds=20.0)
        server = grpc.aio.server()
        server.add_insecure_port(later)

        async def start_late():
            await asyncio.sleep(1.5)
            await server.start()

        starting = asyncio.create_task(start_late())
        waited = await client.wait_ready(poll_seconds=0.5)
        await starting
        await server.stop(None)
        await client.close()
        lone = PoolClient("judge", [nobody], lambda channel: None, 1.0, 1, ready_seconds=1.0)
        try:
            await lone.wait_ready(poll_seconds=0.4)
        except PoolError as error:
            refused = str(error)
        else:
            refused = ""
        await lone.close()
        return waited, refused

    waited, refused = asyncio.run(main())
    assert 1.4 <= waited < 20.0, waited  # it waited for the listener, and it did not run to its bound
    assert refused == f"judge pool: no replica of {nobody} answered within 1s", refused
