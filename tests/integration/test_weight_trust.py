"""Every delivery is verified, whatever its transport, and only this run's versions are taken.

A replica watching a hostile weight-sync (a real gRPC server sending what an attacker would) is sent
an unsigned tensor-less shm announcement of version 10^9, the same for a collective, an old signed
version 1 announced as 7, a version it already serves, and the trainer's own next version over a
FIFO (an open that would never return): it refuses each and stays where it is,
and the trainer's next version (shm, signed) is still applied — a refused number far ahead blocks
nothing. A weight-sync holding this run's instance from Redis refuses a version the same key signed
for an earlier run (v500, "newer"), and the trainer's own next push goes through."""

import asyncio
import os

import grpc
import pytest
import torch
from prometheus_client import REGISTRY

from services.weightsync.config import WeightSyncSettings
from services.weightsync.server import serve as serve_weightsync
from shared.rpc.server import start_server
from shared.rpc.steadyrl.v1 import common_pb2, weightsync_pb2_grpc
from shared.rpc.steadyrl.v1 import weightsync_pb2 as pb
from shared.runstore.redis_server import free_port
from shared.runstore.run_instance import run_instance
from shared.weightsync.grpc import GrpcWeightPublisher
from shared.weightsync.shm import write_shm
from shared.weightsync.signing import Signer, Verifier, write_key_pair
from shared.weightsync.subscriber import WatchSubscriber

TENSORS = {"w": torch.arange(8, dtype=torch.float32)}


class HostileWeightSync(weightsync_pb2_grpc.WeightSyncServicer):
    """Sends its announcements on every Watch, then holds the stream open."""

    def __init__(self, announcements: list[pb.VersionAnnouncement]) -> None:
        self.announcements = announcements

    async def Watch(self, request, context):
        for announcement in self.announcements:
            yield announcement
        await asyncio.Event().wait()

    async def Report(self, request, context):
        return common_pb2.Empty()


def shm(manifest: pb.WeightManifest, path, announced: int | None = None) -> pb.VersionAnnouncement:
    return pb.VersionAnnouncement(
        version=common_pb2.PolicyVersion(version=announced if announced is not None else manifest.version),
        manifest=manifest,
        transport=pb.Transport(kind=pb.SHM, shm_path=str(path)),
    )


def test_a_replica_refuses_every_announcement_it_cannot_verify(tmp_path, monkeypatch):
    monkeypatch.delenv("STEADYRL_TOKEN", raising=False)
    private, public = write_key_pair(tmp_path / "keys")
    signer = Signer.from_file(private, "demo", "c" * 32)
    folder = tmp_path / "shm"
    old = write_shm(folder / "v1.safetensors", TENSORS, 1, 0, signer)
    good = write_shm(folder / "v3.safetensors", {"w": torch.ones(8)}, 3, 2, signer)
    served_two = write_shm(folder / "v2.safetensors", TENSORS, 2, 1, signer)
    later = write_shm(folder / "v4.safetensors", TENSORS, 4, 3, signer)
    hostile = [
        shm(pb.WeightManifest(version=10**9), folder / "v1.safetensors"),  # unsigned, no tensors
        pb.VersionAnnouncement(
            version=common_pb2.PolicyVersion(version=10**9 + 1),
            manifest=pb.WeightManifest(version=10**9 + 1),
            transport=pb.Transport(kind=pb.COLLECTIVE),
        ),
        shm(old, folder / "v1.safetensors", announced=7),  # an old signed version under a new number
        shm(served_two, folder / "v2.safetensors"),  # not newer than what the replica serves
        shm(good, folder / "v3.safetensors"),  # the trainer's next version
        shm(later, folder / "fifo"),  # the trainer's own next manifest over a FIFO: an open that would block
    ]
    os.mkfifo(folder / "fifo")
    applied: list[int] = []

    async def apply(delivery) -> float:
        await asyncio.to_thread(delivery.prepare)  # off the event loop, as a replica applies
        applied.append(delivery.version)
        return 0.0

    def refused_shm() -> float:
        return REGISTRY.get_sample_value("steadyrl_inference_weight_versions_refused_total", {"transport": "shm"}) or 0

    before = refused_shm()

    async def main():
        port = free_port()
        server, _, _ = await start_server(
            [(weightsync_pb2_grpc.add_WeightSyncServicer_to_server, HostileWeightSync(hostile))],
            ["steadyrl.v1.WeightSync"],
            f"127.0.0.1:{port}",
        )
        subscriber = WatchSubscriber(
            f"127.0.0.1:{port}",
            apply,
            "replica-a",
            transports=["shm", "collective"],
            version=2,
            verifier=Verifier.from_file(public, "demo", "c" * 32),
        )
        stop = asyncio.Event()
        task = asyncio.create_task(subscriber.run(stop))
        for _ in range(400):
            if applied and refused_shm() > before:  # v3 applied, then the FIFO's v4 refused (not waited on)
                break
            await asyncio.sleep(0.025)
        stop.set()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await server.stop(None)
        return subscriber

    subscriber = asyncio.run(asyncio.wait_for(main(), 60))
    assert applied == [3] and subscriber.version == 3
    assert sorted(subscriber.refused)[:3] == [7, 10**9, 10**9 + 1]
    assert refused_shm() > before  # the FIFO: refused at once ("not a regular file"), never blocked on


def test_weight_sync_refuses_a_version_signed_for_an_earlier_run(tmp_path, redis_server, run_id, monkeypatch):
    monkeypatch.delenv("STEADYRL_TOKEN", raising=False)
    private, public = write_key_pair(tmp_path / "keys")  # a deployment keeps one pair across runs
    earlier = Signer.from_file(private, run_id, "e" * 32)

    async def main():
        from redis.asyncio import Redis

        redis = Redis.from_url(redis_server.url)
        instance = await run_instance(redis, run_id)  # the first service of this run made it
        again = await run_instance(redis, run_id)
        await redis.aclose()
        port = free_port()
        stop, ready = asyncio.Event(), asyncio.Event()
        settings = WeightSyncSettings(
            port=port,
            metrics_port=0,
            run_id=run_id,
            spill_dir=tmp_path / "spill",
            verify_key_file=public,
            redis_url=redis_server.url,
        )
        service = asyncio.create_task(serve_weightsync(settings, ready, stop))
        await asyncio.wait_for(ready.wait(), 30)
        replayed = GrpcWeightPublisher(f"127.0.0.1:{port}", earlier)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await replayed.push(TENSORS, 500, 499)
        await replayed.close()
        trainer = GrpcWeightPublisher(f"127.0.0.1:{port}", Signer.from_file(private, run_id, instance))
        reply = await trainer.push(TENSORS, 1, 0)
        await trainer.close()
        stop.set()
        await service
        return instance, again, refused.value, reply

    instance, again, refused, reply = asyncio.run(asyncio.wait_for(main(), 60))
    assert instance == again and len(instance) == 32 and instance != "e" * 32
    assert refused.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "another instance of run" in refused.details()
    assert reply.version.version == 1
