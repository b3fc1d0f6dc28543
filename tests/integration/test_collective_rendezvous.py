"""The collective transport's rendezvous: it lives behind weight-sync's
authenticated gRPC methods, so no store port listens anywhere; an epoch's key space is named by a
token only its members learn and no one else can write; every wait is bounded by the service's
collective timeout whatever the caller asks."""

import asyncio
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
from tests.helpers import weight_keys

TOKEN = "rendezvous-test-token"


@pytest.fixture
def weightsync(tmp_path):
    """weight-sync in its own process, on loopback, with a 2 s collective timeout."""
    signer, public = weight_keys(tmp_path)
    port = free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("STEADYRL_")},
        "STEADYRL_TOKEN": TOKEN,
        "STEADYRL_WEIGHTSYNC_PORT": str(port),
        "STEADYRL_WEIGHTSYNC_METRICS_PORT": "0",
        "STEADYRL_WEIGHTSYNC_SPILL_DIR": str(tmp_path / "spill"),
        "STEADYRL_WEIGHTSYNC_VERIFY_KEY_FILE": str(public),
        "STEADYRL_WEIGHTSYNC_COLLECTIVE_TIMEOUT_SECONDS": "2",
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "services.weightsync"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 60
    while not any(c.laddr.port == port for c in psutil.Process(process.pid).net_connections("inet")):
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    yield process, f"127.0.0.1:{port}", signer
    process.terminate()
    process.wait(30)


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
