"""Weight-sync on loopback: a real grpc.aio server, real clients."""

import asyncio
import socket

import grpc
import pytest
import torch

from services.weightsync.config import WeightSyncSettings
from services.weightsync.server import WeightSyncServicer, add_servicer
from shared.rpc import start_server
from shared.rpc.steadyrl.v1 import common_pb2, weightsync_pb2_grpc
from shared.rpc.steadyrl.v1 import weightsync_pb2 as pb
from shared.weightsync.frames import iter_chunks
from shared.weightsync.grpc import GrpcWeightPublisher
from shared.weightsync.manifest import WeightError
from shared.weightsync.signing import Signer, write_key_pair
from shared.weightsync.subscriber import WatchSubscriber
from tests.helpers import build_manifest, pull_all, to_state_dict


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def state(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(64, 32, generator=gen) * scale,
        "layer.0.bf16": (torch.randn(300, 17, generator=gen) * scale).to(torch.bfloat16),
        "layer.0.bias": torch.zeros(17),
        "scalar": torch.tensor(3.5),
    }


class Server:
    """The servicer behind a real gRPC server; restartable on the same port with the same store.
    It takes versions signed by `signer`, the trainer's key of this test."""

    def __init__(self, tmp_path, **overrides):
        self.port = free_port()
        private, public = write_key_pair(tmp_path / "keys")
        self.signer = Signer.from_file(private)
        self.key_file = private
        self.settings = WeightSyncSettings(
            port=self.port, spill_dir=tmp_path / "spill", chunk_bytes=4096, verify_key_file=public, **overrides
        )
        self.servicer = WeightSyncServicer(self.settings)
        self.server = None

    @property
    def address(self):
        return f"127.0.0.1:{self.port}"

    async def start(self):
        self.server, _, _ = await start_server(
            [(add_servicer, self.servicer)], ["steadyrl.v1.WeightSync"], self.address
        )

    async def stop(self):
        await self.server.stop(grace=None)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


def assert_equal_states(a, b):
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape
        assert torch.equal(
            a[name].view(torch.uint8) if a[name].dim() else a[name],
            b[name].view(torch.uint8) if b[name].dim() else b[name],
        )


def test_push_watch_pull_round_trip_is_bit_exact(tmp_path):
    async def main():
        server = Server(tmp_path)
        await server.start()
        received = {}

        async def apply(delivery):  # what an engine does: take each checked bucket
            received[delivery.version] = await asyncio.to_thread(
                lambda: {name: tensor.clone() for bucket in delivery.buckets() for name, tensor in bucket}
            )
            return 0.0

        subscriber = WatchSubscriber(server.address, apply)
        stop = asyncio.Event()
        task = asyncio.create_task(subscriber.run(stop))
        publisher = GrpcWeightPublisher(server.address, server.signer, chunk_bytes=1000)
        for version in (1, 2, 3):
            reply = await publisher.push(state(version), version, version - 1)
            assert reply.version.version == version
            while subscriber.version < version:
                await asyncio.sleep(0.01)
        stop.set()
        task.cancel()
        for version in (1, 2, 3):
            if version in received:
                assert_equal_states(received[version], state(version))
        assert subscriber.applied == sorted(subscriber.applied) and subscriber.applied[-1] == 3
        async with grpc.aio.insecure_channel(server.address) as ch:
            stub = weightsync_pb2_grpc.WeightSyncStub(ch)
            listed = await stub.List(common_pb2.Empty())
            assert [v.version.version for v in listed.versions] == [1, 2, 3]
            assert (await stub.Latest(common_pb2.Empty())).version.version == 3
        await publisher.close()
        await server.stop()

    run(main())


def test_delta_pull_equals_full_pull_and_is_smaller(tmp_path):
    async def main():
        server = Server(tmp_path)
        await server.start()
        publisher = GrpcWeightPublisher(server.address, signer=server.signer)
        base = state(1)
        nxt = {k: v.clone() for k, v in base.items()}
        nxt["embed.weight"][0, :4] += 1.0  # a few elements change; bias and scalar do not
        nxt["layer.0.bf16"] = (nxt["layer.0.bf16"].float() * 1.05).to(torch.bfloat16)
        await publisher.push(base, 1)
        await publisher.push(nxt, 2, 1)
        m1, p1, _ = await asyncio.to_thread(pull_all, server.address, 1)
        held = {spec.name: data for spec, data in zip(m1.tensors, p1, strict=True)}
        full_manifest, full, full_wire = await asyncio.to_thread(pull_all, server.address, 2)
        delta_manifest, delta, delta_wire = await asyncio.to_thread(pull_all, server.address, 2, 1, held.get)
        async with grpc.aio.insecure_channel(server.address) as ch:
            stub = weightsync_pb2_grpc.WeightSyncStub(ch)
            header = None
            async for item in stub.Pull(pb.PullRequest(version=2, base_version=1)):
                header = item.header
                break
        assert full == delta
        assert_equal_states(to_state_dict(delta_manifest, delta), nxt)
        assert list(header.encodings) == [pb.XOR_ZSTD, pb.XOR_ZSTD, pb.UNCHANGED, pb.UNCHANGED]
        assert delta_wire < full_wire / 2
        await publisher.close()
        await server.stop()

    run(main())


def test_a_push_cut_halfway_never_becomes_visible(tmp_path):
    async def main():
        server = Server(tmp_path)
        await server.start()
        manifest, payloads = build_manifest(state(1), 1, 0, server.signer)
        chunks = [c for i, p in enumerate(payloads) for c in iter_chunks(i, p, 512)]
        half = len(chunks) // 2
        release = asyncio.Event()

        async def killed():
            yield pb.PushRequest(manifest=manifest)
            for c in chunks[:half]:
                yield pb.PushRequest(chunk=c)
            await release.wait()  # the publisher "dies" here

        async with grpc.aio.insecure_channel(server.address) as ch:
            stub = weightsync_pb2_grpc.WeightSyncStub(ch)
            call = stub.Push(killed())
            await asyncio.sleep(0.3)
            call.cancel()

            async def truncated():  # a stream that ends early is refused too
                yield pb.PushRequest(manifest=manifest)
                for c in chunks[:half]:
                    yield pb.PushRequest(chunk=c)

            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Push(truncated())
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "incomplete" in err.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Latest(common_pb2.Empty())
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            assert (await stub.List(common_pb2.Empty())).versions == []
        await server.stop()

    run(main())


def test_corrupted_chunk_is_rejected(tmp_path):
    async def main():
        server = Server(tmp_path)
        await server.start()
        manifest, payloads = build_manifest(state(1), 1, 0, server.signer)

        async def corrupted():
            yield pb.PushRequest(manifest=manifest)
            for i, p in enumerate(payloads):
                for c in iter_chunks(i, p, 512):
                    if i == 1 and c.offset == 512:
                        c = pb.TensorChunk(
                            tensor_index=c.tensor_index, offset=c.offset, data=bytes([c.data[0] ^ 1]) + c.data[1:]
                        )
                    yield pb.PushRequest(chunk=c)

        async with grpc.aio.insecure_channel(server.address) as ch:
            stub = weightsync_pb2_grpc.WeightSyncStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Push(corrupted())
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "checksum mismatch" in err.value.details()
            assert (await stub.List(common_pb2.Empty())).versions == []
        await server.stop()

    run(main())


def test_subscriber_resumes_after_its_stream_is_cut(tmp_path):
    async def main():
        server = Server(tmp_path)
        await server.start()

        async def apply(delivery):
            await asyncio.to_thread(lambda: [b for b in delivery.buckets()])
            return 0.0

        subscriber = WatchSubscriber(server.address, apply, backoff=(0.05, 0.2))
        stop = asyncio.Event()
        task = asyncio.create_task(subscriber.run(stop))
        publisher = GrpcWeightPublisher(server.address, signer=server.signer)
        await publisher.push(state(1), 1)
        while subscriber.version < 1:
            await asyncio.sleep(0.01)
        await server.stop()  # cuts the Watch stream
        await asyncio.sleep(0.3)
        await server.start()  # same port, same store
        await publisher.push(state(2), 2, 1)
        await publisher.push(state(3), 3, 2)
        while subscriber.version < 3:
            await asyncio.sleep(0.01)
        stop.set()
        task.cancel()
        assert subscriber.reconnects >= 1
        assert subscriber.applied == sorted(set(subscriber.applied)) and subscriber.applied[-1] == 3
        await publisher.close()
        await server.stop()

    run(main())


def test_only_the_trainers_signed_versions_are_taken_and_a_repeat_is_no_refusal(tmp_path):
    """The token alone publishes nothing; a repeated push of a version it holds
    (a retry after a lost reply) is answered as a success; other weights under a held number are
    refused."""

    async def main():
        server = Server(tmp_path)
        await server.start()
        stranger = Signer.from_file(write_key_pair(tmp_path / "stranger")[0])
        other_run = Signer(server.signer.key, "another-run")
        server.servicer.verifier.run_id = "this-run"
        server.signer.run_id = "this-run"
        codes = []
        for signer in (None, stranger, other_run):
            publisher = GrpcWeightPublisher(server.address, signer=signer)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await publisher.push(state(1), 1)
            codes.append((err.value.code(), err.value.details()))
            await publisher.close()
        publisher = GrpcWeightPublisher(server.address, signer=server.signer)
        assert (await publisher.push(state(1), 1)).version.version == 1
        assert (await publisher.push(state(1), 1)).version.version == 1  # the same weights again: held
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await publisher.push(state(2), 1)  # other weights under a number it holds
        await publisher.close()
        await server.stop()
        return codes, err.value.code()

    codes, repeat = run(main())
    assert [c for c, _ in codes] == [grpc.StatusCode.PERMISSION_DENIED] * 3
    assert ["unsigned" in codes[0][1], "not the run's trainer's" in codes[1][1], "another-run" in codes[2][1]] == [
        True,
        True,
        True,
    ]
    assert repeat == grpc.StatusCode.FAILED_PRECONDITION


def test_retention_spills_to_disk_and_pulls_from_it(tmp_path):
    async def main():
        server = Server(tmp_path, retain_versions=3, memory_versions=1)
        await server.start()
        publisher = GrpcWeightPublisher(server.address, signer=server.signer)
        for version in range(1, 6):
            await publisher.push(state(version), version, version - 1)
        async with grpc.aio.insecure_channel(server.address) as ch:
            stub = weightsync_pb2_grpc.WeightSyncStub(ch)
            listed = (await stub.List(common_pb2.Empty())).versions
            assert [(v.version.version, v.on_disk) for v in listed] == [(3, True), (4, True), (5, False)]
        manifest, payloads, _ = await asyncio.to_thread(pull_all, server.address, 3)
        assert_equal_states(to_state_dict(manifest, payloads), state(3))
        with pytest.raises(WeightError, match="NOT_FOUND"):
            await asyncio.to_thread(pull_all, server.address, 1)
        spilled = sorted(p.name for p in (tmp_path / "spill").iterdir())
        assert spilled[:2] == ["v3", "v4"] and set(spilled) <= {"v3", "v4", "v5"}  # v5: perhaps written ahead
        await publisher.close()
        await server.stop()

    run(main())


def test_spill_files_are_written_ahead_so_an_arrival_only_lets_go_of_the_bytes(tmp_path):
    """As a version is held, the one the next arrival will spill is written to disk at once (its
    bytes kept in memory, still served from there); the arrival then releases it without writing,
    and a spilled version reads back checked against its manifest."""
    import time

    from services.weightsync.store import SPILL_FILE, VersionStore
    from shared.weightsync.shm import map_version

    store = VersionStore(retain=4, in_memory=2, spill_dir=tmp_path)
    for version in (1, 2):
        manifest, payloads = build_manifest(state(version), version, version - 1)
        store.add(manifest, [bytearray(p) for p in payloads])
    first = store.versions[1]
    deadline = time.monotonic() + 30
    while first.path is None and time.monotonic() < deadline:  # the write-ahead thread
        time.sleep(0.01)
    assert first.path == tmp_path / "v1" and first.payloads is not None  # on disk and still in memory
    assert store.versions[2].path is None  # the newest stays: the next arrival keeps it
    written = (first.path / SPILL_FILE).stat().st_mtime_ns
    store.make_room()
    assert first.payloads is None and store.versions[2].payloads is not None
    assert (first.path / SPILL_FILE).stat().st_mtime_ns == written  # released, not written again
    assert [bytes(p) for p in store.payloads(1)] == [bytes(p) for p in build_manifest(state(1), 1, 0)[1]]
    mapped, header, start = map_version(first.path / SPILL_FILE)
    at = start + header["embed.weight"]["data_offsets"][0]
    mapped.close()
    raw = bytearray((first.path / SPILL_FILE).read_bytes())
    raw[at] ^= 0xFF  # one flipped byte of a tensor on disk
    (first.path / SPILL_FILE).write_bytes(bytes(raw))
    with pytest.raises(WeightError, match="checksum"):
        store.payloads(1)


def test_where_retain_equals_memory_versions_no_version_is_written_to_disk(tmp_path):
    """retain_versions = memory_versions = 2: a version past the newest two is dropped, never read
    from disk, so none is written (a 61 GB version would be minutes of disk per step); before each
    arrival one version is held in memory, the arriving one making two."""
    import threading

    from services.weightsync.store import VersionStore

    store = VersionStore(retain=2, in_memory=2, spill_dir=tmp_path / "spill")
    held = []
    for version in range(1, 7):
        store.make_room()
        held.append(sum(s.payloads is not None for s in store.versions.values()))
        manifest, payloads = build_manifest(state(version), version, version - 1)
        store.add(manifest, [bytearray(p) for p in payloads])
    for thread in threading.enumerate():
        if thread.name == "weightsync-spill":
            thread.join(60)
    assert held == [0, 1, 1, 1, 1, 1]
    assert sorted(store.versions) == [5, 6] and all(s.payloads is not None for s in store.versions.values())
    assert not (tmp_path / "spill").exists() or not any((tmp_path / "spill").rglob("*"))
    assert [bytes(p) for p in store.payloads(5)] == [bytes(p) for p in build_manifest(state(5), 5, 4)[1]]


def test_with_one_version_retained_the_newest_is_spilled_not_let_go_of_before_an_arrival(tmp_path):
    """retain_versions = 1: before the next bytes arrive the only version leaves memory for the
    disk, so a push that then fails leaves it servable."""
    from services.weightsync.store import VersionStore

    store = VersionStore(retain=1, in_memory=1, spill_dir=tmp_path / "spill")
    manifest, payloads = build_manifest(state(1), 1, 0)
    store.add(manifest, [bytearray(p) for p in payloads])
    store.make_room()
    only = store.versions[1]
    assert only.payloads is None and not only.dropped and only.path == tmp_path / "spill" / "v1"
    assert [bytes(p) for p in store.payloads(1)] == [bytes(p) for p in payloads]


def test_dropping_a_version_never_waits_for_a_write_of_it(tmp_path):
    """An arrival that drops a version whose spill file is being written (here: the writer waits on
    the disk, held by the test) returns at once; the writer then writes nothing for it. The shm
    announce that drops it used to wait for that write (3-4 s per GiB of a useless file)."""
    import threading

    from services.weightsync.store import VersionStore

    store = VersionStore(retain=3, in_memory=1, spill_dir=tmp_path / "spill")
    with store._disk:  # the disk busy: v1's write ahead (started by its arrival) waits for it
        manifest, payloads = build_manifest(state(1), 1, 0)
        store.add(manifest, [bytearray(p) for p in payloads])
        first = store.versions[1]
        arrivals = threading.Thread(
            target=lambda: [
                store.add_shm(build_manifest(state(v), v, v - 1)[0], tmp_path / f"v{v}.safetensors") for v in (2, 3, 4)
            ]
        )
        arrivals.start()
        arrivals.join(10)
        assert not arrivals.is_alive()  # v4's arrival dropped v1 without waiting for the disk
        assert sorted(store.versions) == [2, 3, 4] and first.dropped and first.payloads is None
    for thread in threading.enumerate():
        if thread.name == "weightsync-spill":
            thread.join(60)
    assert first.path is None and not (tmp_path / "spill" / "v1").exists()  # its writer wrote nothing


def test_a_push_spills_before_its_bytes_arrive_so_memory_never_holds_more_than_memory_versions(tmp_path):
    """memory_versions = 2 counts the version arriving: before each push's bytes, the store holds
    one version in memory, never two beside the new one."""

    async def main():
        server = Server(tmp_path, retain_versions=4, memory_versions=2)
        store = server.servicer.store
        held = []
        make_room = store.make_room

        def recorded():
            make_room()
            held.append(sum(s.payloads is not None for s in store.versions.values()))

        store.make_room = recorded
        await server.start()
        publisher = GrpcWeightPublisher(server.address, signer=server.signer)
        for version in range(1, 6):
            await publisher.push(state(version), version, version - 1)
        async with grpc.aio.insecure_channel(server.address) as ch:
            listed = (await weightsync_pb2_grpc.WeightSyncStub(ch).List(common_pb2.Empty())).versions
        manifest, payloads, _ = await asyncio.to_thread(pull_all, server.address, 3)  # a spilled one still pulls
        await publisher.close()
        await server.stop()
        return held, [(v.version.version, v.on_disk) for v in listed], to_state_dict(manifest, payloads)

    held, listed, third = run(main())
    assert held == [0, 1, 1, 1, 1]  # in memory as each push's bytes start arriving (+1 arriving = 2 at most)
    assert listed == [(2, True), (3, True), (4, False), (5, False)]
    assert_equal_states(third, state(3))


def test_bad_manifests_get_invalid_argument(tmp_path):
    async def main():
        server = Server(tmp_path)
        await server.start()
        manifest, _ = build_manifest(state(1), 1, 0)
        bad = pb.WeightManifest()
        bad.CopyFrom(manifest)
        bad.tensors[0].nbytes += 4

        async def one(msg):
            yield msg

        async with grpc.aio.insecure_channel(server.address) as ch:
            stub = weightsync_pb2_grpc.WeightSyncStub(ch)
            for request, text in [
                (pb.PushRequest(manifest=bad), "nbytes"),
                (pb.PushRequest(chunk=pb.TensorChunk()), "first message"),
                (pb.PushRequest(manifest=pb.WeightManifest(version=1)), "no tensors"),
            ]:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Push(one(request))
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert text in err.value.details()
        await server.stop()

    run(main())


def test_generated_clients_decode_the_hand_built_frames_and_stripes_partition_them(tmp_path):
    async def main():
        server = Server(tmp_path)
        await server.start()
        publisher = GrpcWeightPublisher(server.address, signer=server.signer)
        await publisher.push(state(7), 1)
        single_manifest, single, single_wire = await asyncio.to_thread(pull_all, server.address, 1)
        assert single_wire == sum(t.nbytes for t in single_manifest.tensors)
        # the stock generated stub parses the hand-built chunk frames; stripe 1 of 3 gets a third
        channel = grpc.aio.insecure_channel(server.address)
        stub = weightsync_pb2_grpc.WeightSyncStub(channel)
        items = [m async for m in stub.Pull(pb.PullRequest(version=1, stripe=1, stripes=3))]
        chunks = [m.chunk for m in items[1:]]
        sequence = [(c.tensor_index, c.offset) for c in chunks]
        all_chunks = [(i, o) for i, t in enumerate(single_manifest.tensors) for o in range(0, t.nbytes, 4096)]
        assert sequence == all_chunks[1::3]
        for c in chunks:
            assert bytes(c.data) == bytes(single[c.tensor_index][c.offset : c.offset + len(c.data)])
        with pytest.raises(grpc.aio.AioRpcError) as err:
            _ = [m async for m in stub.Pull(pb.PullRequest(version=1, stripe=3, stripes=3))]
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        await channel.close()
        await publisher.close()
        await server.stop()

    run(main())


KILLED_PUBLISHER = """
import asyncio, sys, grpc, torch
from shared.rpc.steadyrl.v1 import weightsync_pb2 as pb, weightsync_pb2_grpc
from shared.weightsync.frames import iter_chunks
from shared.weightsync.signing import Signer
from tests.helpers import build_manifest

async def main():
    tensors = {f"w{i}": torch.full((256, 1024), float(i)) for i in range(8)}
    manifest, payloads = build_manifest(tensors, 1, 0, Signer.from_file(sys.argv[2]))
    chunks = [c for i, p in enumerate(payloads) for c in iter_chunks(i, p, 65536)]

    async def requests():
        yield pb.PushRequest(manifest=manifest)
        for c in chunks[: len(chunks) // 2]:
            yield pb.PushRequest(chunk=c)
        print("HALF", flush=True)
        await asyncio.Event().wait()

    async with grpc.aio.insecure_channel(sys.argv[1]) as ch:
        await weightsync_pb2_grpc.WeightSyncStub(ch).Push(requests())

asyncio.run(main())
"""


def test_a_publisher_sigkilled_mid_push_leaves_no_version(tmp_path):
    import os
    import signal
    import subprocess
    import sys

    from prometheus_client import REGISTRY

    def cancelled() -> float:  # the cut stream ends early ("invalid") or is cancelled
        return sum(
            REGISTRY.get_sample_value("steadyrl_weightsync_failures_total", {"op": "push", "reason": r}) or 0.0
            for r in ("invalid", "cancelled")
        )

    async def main():
        server = Server(tmp_path)
        await server.start()
        before = cancelled()
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-c", KILLED_PUBLISHER, server.address, str(server.key_file), stdout=subprocess.PIPE
        )
        assert (await asyncio.wait_for(child.stdout.readline(), 30)).strip() == b"HALF"
        await asyncio.sleep(0.2)  # let the half reach the server
        os.kill(child.pid, signal.SIGKILL)
        assert await child.wait() == -signal.SIGKILL
        for _ in range(100):
            if cancelled() > before:
                break
            await asyncio.sleep(0.05)
        assert cancelled() == before + 1
        async with grpc.aio.insecure_channel(server.address) as ch:
            stub = weightsync_pb2_grpc.WeightSyncStub(ch)
            assert (await stub.List(common_pb2.Empty())).versions == []
            publisher = GrpcWeightPublisher(
                server.address, signer=server.signer
            )  # the same version number is free again
            await publisher.push(state(1), 1)
            assert [v.version.version for v in (await stub.List(common_pb2.Empty())).versions] == [1]
            await publisher.close()
        await server.stop()

    run(main())


def test_a_version_the_service_will_never_hold_is_superseded_by_its_newest(tmp_path):
    """A refused shm version is pulled over gRPC once the service holds it; a restarted service
    holds only what came after it, so the subscriber takes the newest instead of waiting."""

    async def main():
        server = Server(tmp_path)
        await server.start()
        applied = []

        async def apply(delivery):
            applied.append(
                (delivery.version, await asyncio.to_thread(lambda: dict(kv for b in delivery.buckets() for kv in b)))
            )
            return 0.0

        publisher = GrpcWeightPublisher(server.address, server.signer)
        await publisher.push(state(1), 1)
        await publisher.push(state(3), 3)  # version 2 was published to the service before it restarted
        subscriber = WatchSubscriber(server.address, apply)
        assert await subscriber._pull_when_held(2, patience=600)  # run() bounds this at 60 s
        assert subscriber.version == 3 and [version for version, _ in applied] == [3]
        assert_equal_states(applied[0][1], state(3))
        assert not await subscriber._pull_when_held(4, patience=1.2)  # nothing newer: waits its patience out
        assert subscriber.version == 3
        await publisher.close()
        await server.stop()

    run(main())
