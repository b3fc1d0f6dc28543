"""The collective transport's rendezvous: it lives behind weight-sync's
authenticated gRPC methods, so no store port listens anywhere; an epoch's key space is named by a
token only its members learn and no one else can write; every wait is bounded by the service's
collective timeout whatever the caller asks."""

import asyncio
import contextlib
import os
import subprocess
import sys
import time

import grpc
import psutil
import pytest
import torch

from shared.rpc.auth import channel
from shared.rpc.steadyrl.v1 import weightsync_pb2 as pb
from shared.rpc.steadyrl.v1 import weightsync_pb2_grpc
from shared.runstore.redis_server import free_port
from shared.weightsync import make_publisher
from shared.weightsync.grpc import GrpcWeightPublisher
from tests.helpers import weight_keys

TOKEN = "rendezvous-test-token"


@contextlib.contextmanager
def weightsync_process(tmp_path, token: str = TOKEN, **settings: str):
    """weight-sync in its own process on a free loopback port, with `token` and the given
    STEADYRL_WEIGHTSYNC_* settings; yields (process, address)."""
    port = free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("STEADYRL_")},
        "STEADYRL_TOKEN": token,
        "STEADYRL_WEIGHTSYNC_PORT": str(port),
        "STEADYRL_WEIGHTSYNC_METRICS_PORT": "0",
        "STEADYRL_WEIGHTSYNC_SPILL_DIR": str(tmp_path / "spill"),
        **{f"STEADYRL_WEIGHTSYNC_{k.upper()}": v for k, v in settings.items()},
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "services.weightsync"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 60
        while not any(c.laddr.port == port for c in psutil.Process(process.pid).net_connections("inet")):
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        yield process, f"127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(30)


@pytest.fixture
def weightsync(tmp_path):
    """weight-sync in its own process, on loopback, with a 2 s collective timeout."""
    signer, public = weight_keys(tmp_path)
    with weightsync_process(tmp_path, verify_key_file=str(public), collective_timeout_seconds="2") as (
        process,
        address,
    ):
        yield process, address, signer


def test_no_store_port_and_an_epochs_rendezvous_refuses_strangers(weightsync, monkeypatch):
    process, address, signer = weightsync
    monkeypatch.setenv("STEADYRL_TOKEN", TOKEN)
    tensors = {"w": torch.arange(64, dtype=torch.float32)}

    async def main():
        publisher = make_publisher("collective", address, signer)  # weight-sync is the epoch's only member
        reply = await publisher.push(tensors, 1, 0, timeout=30)
        transport = reply.transport
        async with channel(address) as ch:
            stub = weightsync_pb2_grpc.WeightSyncStub(ch)
            codes = {}
            for name, key in (
                ("wrong name", pb.RendezvousKey(epoch=transport.epoch, rendezvous="guessed", key="0")),
                ("next epoch", pb.RendezvousKey(epoch=transport.epoch + 1, rendezvous=transport.rendezvous, key="0")),
                (
                    "too large",
                    pb.RendezvousKey(
                        epoch=transport.epoch, rendezvous=transport.rendezvous, key="k", value=b"x" * (1 << 17)
                    ),
                ),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.RendezvousPut(key)
                codes[name] = err.value.code()
            with pytest.raises(grpc.aio.AioRpcError) as err:  # asks for 1000 s, the service waits 2 s
                await stub.RendezvousWait(
                    pb.RendezvousKey(
                        epoch=transport.epoch, rendezvous=transport.rendezvous, key="never-set", timeout_seconds=1000
                    ),
                    timeout=30,
                )
            codes["wait"] = err.value.code()
        async with channel(address, token="not-the-token") as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await weightsync_pb2_grpc.WeightSyncStub(ch).RendezvousPut(
                    pb.RendezvousKey(
                        epoch=transport.epoch, rendezvous=transport.rendezvous, key="planted", value=b"10.9.9.9:1"
                    )
                )
            codes["no token"] = err.value.code()
        await publisher.close()
        return transport, codes

    transport, codes = asyncio.run(asyncio.wait_for(main(), 60))
    assert len(transport.rendezvous) >= 32  # 24 random bytes, URL-safe
    assert codes == {
        "wrong name": grpc.StatusCode.PERMISSION_DENIED,
        "next epoch": grpc.StatusCode.PERMISSION_DENIED,
        "too large": grpc.StatusCode.PERMISSION_DENIED,
        "wait": grpc.StatusCode.DEADLINE_EXCEEDED,
        "no token": grpc.StatusCode.UNAUTHENTICATED,
    }
    listening = [c.laddr for c in psutil.Process(process.pid).net_connections("inet") if c.status == "LISTEN"]
    loopback = ("127.0.0.1", "::ffff:127.0.0.1")  # the configured host (an IPv6 socket may hold it mapped)
    assert listening and all(addr.ip in loopback for addr in listening), listening  # nothing on [::] or 0.0.0.0


def test_a_wait_names_any_timeout_and_the_service_still_bounds_it(weightsync, monkeypatch):
    """NaN or a negative wait is refused at once; an infinite or huge one waits the service's bound
    (2 s here), answered by the service itself, well before the caller's own 30 s deadline."""
    process, address, signer = weightsync
    monkeypatch.setenv("STEADYRL_TOKEN", TOKEN)

    async def main():
        publisher = make_publisher("collective", address, signer)
        reply = await publisher.push({"w": torch.arange(8, dtype=torch.float32)}, 1, 0, timeout=30)
        transport = reply.transport
        answers = {}
        async with channel(address) as ch:
            stub = weightsync_pb2_grpc.WeightSyncStub(ch)
            for name, seconds in (("nan", float("nan")), ("-1", -1.0), ("inf", float("inf")), ("1e308", 1e308)):
                key = pb.RendezvousKey(
                    epoch=transport.epoch, rendezvous=transport.rendezvous, key="never-set", timeout_seconds=seconds
                )
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.RendezvousWait(key, timeout=30)
                answers[name] = (err.value.code(), err.value.details())
        await publisher.close()
        return answers

    answers = asyncio.run(asyncio.wait_for(main(), 120))
    assert answers["nan"][0] == grpc.StatusCode.INVALID_ARGUMENT and "timeout_seconds" in answers["nan"][1]
    assert answers["-1"][0] == grpc.StatusCode.INVALID_ARGUMENT and "timeout_seconds" in answers["-1"][1]
    for name in ("inf", "1e308"):  # the service's answer (its bound), not the caller's deadline
        assert answers[name][0] == grpc.StatusCode.DEADLINE_EXCEEDED and "not set in time" in answers[name][1]


def test_concurrent_adds_from_several_clients_sum_exactly(tmp_path):
    """RendezvousAdd from 4 gRPC clients at once, while 4 threads of the service's own process add
    to the same key as its rank of a group does (`Rendezvous.add` off the event loop): the sum is
    exact. Amounts that are no decimal int64, or a sum past int64, are refused and change nothing."""
    import threading

    from tests.integration.test_weightsync import Server

    server = Server(tmp_path)
    rendezvous = server.servicer.transfers.rendezvous
    name = rendezvous.open(1)
    clients, per_client, threads, per_thread = 4, 500, 4, 20_000

    async def main():
        await server.start()

        async def client(index: int) -> None:
            async with channel(server.address, token="") as ch:
                stub = weightsync_pb2_grpc.WeightSyncStub(ch)
                for _ in range(per_client):
                    await stub.RendezvousAdd(pb.RendezvousKey(epoch=1, rendezvous=name, key="sum", value=b"1"))

        def local() -> None:
            for _ in range(per_thread):
                rendezvous.add(1, name, "sum", 1)

        workers = [threading.Thread(target=local) for _ in range(threads)]
        for worker in workers:
            worker.start()
        await asyncio.gather(*(client(i) for i in range(clients)))
        await asyncio.to_thread(lambda: [w.join() for w in workers])
        refused = {}
        async with channel(server.address, token="") as ch:
            stub = weightsync_pb2_grpc.WeightSyncStub(ch)
            total = await stub.RendezvousAdd(pb.RendezvousKey(epoch=1, rendezvous=name, key="sum", value=b"0"))

            async def code(key: str, amount: bytes) -> grpc.StatusCode:
                try:
                    await stub.RendezvousAdd(pb.RendezvousKey(epoch=1, rendezvous=name, key=key, value=amount))
                except grpc.aio.AioRpcError as err:
                    return err.code()
                return grpc.StatusCode.OK

            for amount in (b"1e3", b" 1", b"1_0", b"x", b"9223372036854775808", b"9" * 5000):
                refused[amount[:20]] = await code("sum", amount)
            await code("big", b"9223372036854775807")
            refused["overflow"] = await code("big", b"1")  # past int64, as torch's stores count
            after = await stub.RendezvousAdd(pb.RendezvousKey(epoch=1, rendezvous=name, key="sum", value=b"0"))
        await server.stop()
        return int(total.value), refused, int(after.value)

    total, refused, after = asyncio.run(asyncio.wait_for(main(), 300))
    assert total == clients * per_client + threads * per_thread, total
    assert set(refused.values()) == {grpc.StatusCode.INVALID_ARGUMENT} and len(refused) == 7, refused
    assert after == total  # the refused adds changed nothing


def test_a_subscriber_id_held_by_an_open_stream_is_refused_to_another(tmp_path):
    """Two members naming one subscriber id: the second is refused (ALREADY_EXISTS, the id named)
    and the first keeps receiving every version; once the first's stream ends, the id is free —
    at once when a member subscribes again after closing its own stream (a collective rejoin)."""
    from tests.integration.test_weightsync import Server, state

    server = Server(tmp_path)

    async def main():
        await server.start()
        publisher = GrpcWeightPublisher(server.address, signer=server.signer)
        first_channel = channel(server.address, token="")
        second_channel = channel(server.address, token="")
        request = pb.WatchRequest(subscriber_id="replica-a", host="h")
        first = weightsync_pb2_grpc.WeightSyncStub(first_channel).Watch(request)
        await publisher.push(state(1), 1, 0, timeout=30)
        assert (await first.read()).version.version == 1  # the first holds the id
        second = weightsync_pb2_grpc.WeightSyncStub(second_channel).Watch(request)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await second.read()
        await publisher.push(state(2), 2, 1, timeout=30)
        received = (await asyncio.wait_for(first.read(), 10)).version.version  # not starved
        first.cancel()  # the member closes its stream and subscribes again at once
        again = weightsync_pb2_grpc.WeightSyncStub(second_channel).Watch(request)
        rejoined = (await asyncio.wait_for(again.read(), 10)).version.version
        again.cancel()
        await publisher.close()
        await first_channel.close()
        await second_channel.close()
        await server.stop()
        return err.value, received, rejoined

    refused, received, rejoined = asyncio.run(asyncio.wait_for(main(), 60))
    assert refused.code() == grpc.StatusCode.ALREADY_EXISTS and "replica-a" in refused.details()
    assert received == 2 and rejoined == 2
