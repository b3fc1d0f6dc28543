"""Every weight transport delivers bit-exact weights to a replica's torch engine — gRPC chunks, a
shared-memory file, a gloo broadcast — and a corrupted or unsigned version is refused on each."""

import asyncio
import re

import grpc
import pytest
import torch

from shared.models import load_causal_lm
from shared.rpc.steadyrl.v1 import common_pb2
from shared.weightsync import make_publisher
from shared.weightsync.manifest import CastView
from tests.integration.test_inference import Replica, _version_is, wait_for


def versions(model_dir, count: int) -> list[dict[str, torch.Tensor]]:
    """`count` distinct bf16 versions of the tiny model (what a trainer publishes)."""
    out = []
    for v in range(count):
        model = load_causal_lm(model_dir, "float32")
        with torch.no_grad():
            model.lm_head.weight.mul_(1.0 + 0.1 * (v + 1))
            model.model.layers[1].mlp.gate.weight.add_(0.01 * (v + 1))
        out.append(dict(CastView(model.state_dict(), torch.bfloat16)))
    return out


def served(engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.model.state_dict().items()}


@pytest.mark.parametrize("kind", ["grpc", "shm", "collective"])
def test_a_transport_delivers_bit_exact_weights_and_refuses_bad_ones(
    tmp_path, tiny_model_dir, redis_server, run_id, kind
):
    good = versions(tiny_model_dir, 2)

    async def main():
        ws = {"shm_dir": tmp_path / "shm", "collective_timeout_seconds": 5}
        async with Replica(
            tmp_path,
            tiny_model_dir,
            redis_server.url,
            run_id,
            ws_overrides=ws,
            weight_transports=["shm", "collective", "grpc"],
        ) as replica:
            address = f"127.0.0.1:{replica.ws_port}"
            await wait_for(subscribed, 30)  # the replica watches: it is a member from the first version
            signed = make_publisher(kind, address, replica.signer, shm_dir=tmp_path / "shm" / "run")
            unsigned = make_publisher(kind, address, None, shm_dir=tmp_path / "shm" / "run")
            await signed.push(good[0], 1, 0, timeout=60)
            await wait_for(lambda: _version_is(replica.stub, 1), 60)
            first = served(replica.engine)
            refused = {}
            refusals = refused_by(kind)
            with pytest.raises(grpc.aio.AioRpcError) as err:  # no signature: the service refuses it
                await unsigned.push(good[1], 2, 1, timeout=60)
            refused["unsigned"] = err.value.code()
            corrupt = dict(good[1])
            corrupt["lm_head.weight"] = corrupt["lm_head.weight"].clone()
            if kind == "grpc":  # bytes that differ from what the signed manifest says
                from shared.weightsync.manifest import describe

                manifest = describe(good[1], 2, 1, replica.signer)
                refused["corrupt"] = await push_mismatched(signed, manifest, corrupt)
            elif kind == "shm":  # the file changed after it was written and digested
                refused["corrupt"] = await announce_tampered_file(signed, good[1], tmp_path / "shm" / "run", 2)
            else:  # the broadcast carries other bytes than the manifest's
                refused["corrupt"] = await broadcast_mismatched(signed, good[1], corrupt, 2)
            if kind != "grpc":  # the replica got it, and refused it: however long that took, it is read after
                await wait_for(lambda: refused_more(kind, refusals), 60)
            refused["by_replica"] = refused_by(kind) - refusals
            after = (await replica.stub.Status(common_pb2.Empty())).version.version
            still = served(replica.engine)
            received = received_by(kind)
            await signed.close()
            await unsigned.close()
        return first, refused, after, still, received

    before = received_by(kind)
    first, refused, after, still, received = asyncio.run(asyncio.wait_for(main(), 180))
    expected = {k: v.float() for k, v in good[0].items()}
    assert all(torch.equal(first[k], expected[k]) for k in expected)  # bit-exact (bf16 values in fp32)
    assert received - before == 1  # it came by this transport (no fallback), and only the good version did
    assert refused["unsigned"] == grpc.StatusCode.PERMISSION_DENIED
    assert (
        refused["corrupt"] == {"grpc": grpc.StatusCode.INVALID_ARGUMENT, "shm": "announced", "collective": "sent"}[kind]
    )
    # the replica refused it (again, maybe, on a retry by gRPC); grpc's bad pushes never left the service
    assert refused["by_replica"] >= 1 if kind != "grpc" else refused["by_replica"] == 0
    assert after == 1 and all(torch.equal(still[k], first[k]) for k in first)  # nothing corrupted was ever served


@pytest.mark.parametrize("kind", ["shm", "grpc"])
def test_a_staged_version_holds_the_weights_it_read_and_is_out_only_once_completed(
    tmp_path, tiny_model_dir, redis_server, run_id, kind
):
    """What the trainer's next step may overlap: `stage` reads the weights (shm: the file written)
    and returns; the completion (shm: the announcement) needs them no more. The tensors changed
    after the stage (the next step training) change nothing served. grpc sends while it reads:
    its stage is the whole push."""
    from shared.weightsync.grpc import latest_version

    good = versions(tiny_model_dir, 1)[0]
    source = {name: tensor.clone() for name, tensor in good.items()}

    async def main():
        ws = {"shm_dir": tmp_path / "shm"}
        async with Replica(
            tmp_path, tiny_model_dir, redis_server.url, run_id, ws_overrides=ws, weight_transports=["shm", "grpc"]
        ) as replica:
            address = f"127.0.0.1:{replica.ws_port}"
            publisher = make_publisher(kind, address, replica.signer, shm_dir=tmp_path / "shm" / "run")
            complete = await publisher.stage(source, 1, 0, timeout=60)
            held_after_stage = await latest_version(address)
            for tensor in source.values():  # the next step trains the model the version came from
                tensor.add_(1.0)
            await complete()
            held_after_completion = await latest_version(address)
            await wait_for(lambda: _version_is(replica.stub, 1), 60)
            await publisher.close()
            return held_after_stage, held_after_completion, served(replica.engine)

    held_after_stage, held_after_completion, weights = asyncio.run(asyncio.wait_for(main(), 120))
    assert held_after_stage == {"shm": 0, "grpc": 1}[kind]
    assert held_after_completion == 1
    assert all(torch.equal(weights[k], good[k].float()) for k in good)  # the bytes as staged


def test_a_version_failing_half_way_is_never_served_mixed(tmp_path, tiny_model_dir, redis_server, run_id):
    """A broadcast in 64 KiB buckets whose last bucket is corrupt: the buckets before it have landed
    in the engine's parameters, so the replica restores the version it served before, whole, by
    a pull — it serves version 1 bit-exact again, never a mix of 1 and 2."""
    from shared.weightsync.subscriber import RESTORED

    good = versions(tiny_model_dir, 2)

    async def main():
        ws = {"collective_timeout_seconds": 5, "bucket_bytes": 64 * 1024}
        async with Replica(
            tmp_path,
            tiny_model_dir,
            redis_server.url,
            run_id,
            ws_overrides=ws,
            weight_transports=["collective", "grpc"],
        ) as replica:
            await wait_for(subscribed, 30)
            publisher = make_publisher("collective", f"127.0.0.1:{replica.ws_port}", replica.signer)
            await publisher.push(good[0], 1, 0, timeout=60)
            await wait_for(lambda: _version_is(replica.stub, 1), 60)
            restores = RESTORED._value.get()
            corrupt = dict(good[1])
            corrupt["lm_head.weight"] = corrupt["lm_head.weight"].clone()
            await broadcast_mismatched(publisher, good[1], corrupt, 2)
            for _ in range(600):  # restored: version 1 again, after a moment of serving nothing
                if RESTORED._value.get() > restores:
                    break
                await asyncio.sleep(0.05)
            restored = RESTORED._value.get() - restores
            after = (await replica.stub.Status(common_pb2.Empty())).version.version
            weights = served(replica.engine)
            await publisher.close()
        return restored, after, weights

    restored, after, weights = asyncio.run(asyncio.wait_for(main(), 180))
    names = list(good[1])
    assert names[-1] == "lm_head.weight"  # the corrupt tensor travels in the last bucket
    assert restored == 1 and after == 1
    assert all(torch.equal(weights[k], good[0][k].float()) for k in good[0])  # version 1, every tensor


async def subscribed() -> bool:
    from prometheus_client import REGISTRY

    return (REGISTRY.get_sample_value("steadyrl_weightsync_subscribers") or 0) >= 1


def received_by(kind: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("steadyrl_inference_weight_versions_received_total", {"transport": kind}) or 0.0


def refused_by(kind: str) -> float:
    """Versions this process's replica refused that came by `kind` (its Prometheus counter)."""
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("steadyrl_inference_weight_versions_refused_total", {"transport": kind}) or 0.0


async def refused_more(kind: str, than: float) -> bool:
    return refused_by(kind) > than


async def announce_tampered_file(publisher, tensors, directory, version: int) -> str:
    """A version file digested as written, then changed before a replica maps it."""
    from shared.rpc.steadyrl.v1 import weightsync_pb2 as pb
    from shared.weightsync.shm import write_shm

    path = directory / f"v{version}.safetensors"
    manifest = write_shm(path, tensors, version, version - 1, publisher.grpc.signer)
    data = bytearray(path.read_bytes())
    data[-2] ^= 0xFF  # a byte of the last tensor
    path.write_bytes(bytes(data))
    await publisher.grpc.stub.Announce(
        pb.AnnounceRequest(manifest=manifest, transport=pb.Transport(kind=pb.SHM, shm_path=str(path))), timeout=60
    )
    return "announced"


async def push_mismatched(publisher, manifest, tensors) -> grpc.StatusCode:
    from shared.rpc.steadyrl.v1 import weightsync_pb2 as pb
    from shared.weightsync.frames import iter_chunks
    from shared.weightsync.manifest import tensor_to_bytes

    tensors["lm_head.weight"].view(-1)[0] += 1

    def requests():
        yield pb.PushRequest(manifest=manifest)
        for index, name in enumerate(tensors):
            for chunk in iter_chunks(index, tensor_to_bytes(tensors[name]), 1 << 20):
                yield pb.PushRequest(chunk=chunk)

    with pytest.raises(grpc.aio.AioRpcError) as err:
        await publisher.stub.Push(requests(), timeout=60)
    return err.value.code()


async def broadcast_mismatched(publisher, good, corrupt, version: int) -> str:
    """Announce the good version's manifest, broadcast corrupted bytes."""
    from shared.rpc.steadyrl.v1 import weightsync_pb2 as pb
    from shared.weightsync.collective import send_version
    from shared.weightsync.manifest import describe

    corrupt["lm_head.weight"].view(-1)[0] += 1
    manifest = describe(good, version, version - 1, publisher.grpc.signer)
    reply = await publisher.grpc.stub.Announce(
        pb.AnnounceRequest(manifest=manifest, transport=pb.Transport(kind=pb.COLLECTIVE, backend="gloo")), timeout=60
    )
    await asyncio.to_thread(
        lambda: send_version(publisher.groups.get(reply.transport, 0), reply.transport, manifest, corrupt)
    )
    return "sent"


def test_a_collective_version_crosses_three_addresses(tmp_path, tiny_model_dir, redis_server):
    """Weight-sync bound to 127.0.0.3 alone (its gRPC port, which also holds the collective's
    rendezvous), a replica process bound to 127.0.0.4, the trainer's publisher in this process
    dialling 127.0.0.3: the version reaches the replica by the broadcast itself — an address that
    fell back to 127.0.0.1 anywhere would leave it to gRPC."""
    import os
    import subprocess
    import sys

    from shared.rpc.steadyrl.v1 import inference_pb2_grpc
    from shared.runstore.redis_server import free_port
    from shared.weightsync.signing import Signer, write_key_pair

    ws_port = free_port("127.0.0.3")
    port = free_port("127.0.0.4")
    private, public = write_key_pair(tmp_path / "keys")
    base = {k: v for k, v in os.environ.items() if not k.startswith("STEADYRL_")}
    services = {
        "weightsync": {
            "STEADYRL_WEIGHTSYNC_HOST": "127.0.0.3",
            "STEADYRL_WEIGHTSYNC_PORT": str(ws_port),
            "STEADYRL_WEIGHTSYNC_METRICS_PORT": "0",
            "STEADYRL_WEIGHTSYNC_SPILL_DIR": str(tmp_path / "spill"),
            "STEADYRL_WEIGHTSYNC_COLLECTIVE_TIMEOUT_SECONDS": "20",
            "STEADYRL_WEIGHTSYNC_VERIFY_KEY_FILE": str(public),
            "STEADYRL_WEIGHTSYNC_REDIS_URL": redis_server.url,  # the run's instance, as the replica's
            "STEADYRL_WEIGHTSYNC_RUN_ID": "hosts",
        },
        "inference": {
            "STEADYRL_INFERENCE_HOST": "127.0.0.4",
            "STEADYRL_INFERENCE_PORT": str(port),
            "STEADYRL_INFERENCE_METRICS_PORT": "0",
            "STEADYRL_INFERENCE_MODEL_PATH": str(tiny_model_dir),
            "STEADYRL_INFERENCE_DTYPE": "bfloat16",
            "STEADYRL_INFERENCE_REDIS_URL": redis_server.url,
            "STEADYRL_INFERENCE_RUN_ID": "hosts",
            "STEADYRL_INFERENCE_REPLICA_ID": "replica-hosts",
            "STEADYRL_INFERENCE_WEIGHTSYNC_ADDRESS": f"127.0.0.3:{ws_port}",
            "STEADYRL_INFERENCE_WEIGHT_TRANSPORTS": '["collective", "grpc"]',
            "STEADYRL_INFERENCE_VERIFY_KEY_FILE": str(public),
        },
    }
    processes = {}
    logs = {name: tmp_path / f"{name}.log" for name in services}
    for name, env in services.items():
        with logs[name].open("wb") as log:
            processes[name] = subprocess.Popen(
                [sys.executable, "-m", f"services.{name}"], env={**base, **env}, stdout=log, stderr=subprocess.STDOUT
            )
    good = versions(tiny_model_dir, 2)

    async def version_served(stub) -> int:
        try:
            return (await stub.Status(common_pb2.Empty(), timeout=2)).version.version
        except grpc.aio.AioRpcError:
            return -1

    async def main() -> list[int]:
        channel = grpc.aio.insecure_channel(f"127.0.0.4:{port}")
        stub = inference_pb2_grpc.InferenceStub(channel)
        from redis.asyncio import Redis

        from shared.runstore.run_instance import run_instance

        redis = Redis.from_url(redis_server.url)
        instance = await run_instance(redis, "hosts")  # the trainer signs the run's instance
        await redis.aclose()
        publisher = make_publisher("collective", f"127.0.0.3:{ws_port}", Signer.from_file(private, "hosts", instance))
        served = []
        try:
            await wait_for(lambda: version_served_is(stub, 0), 120)  # up, serving its initial weights
            for version in (1, 2):
                await publisher.push(good[version - 1], version, version - 1, timeout=60)
                await wait_for(lambda v=version: version_served_is(stub, v), 60)
                served.append(await version_served(stub))
        finally:
            await publisher.close()
            await channel.close()
        return served

    async def version_served_is(stub, version: int) -> bool:
        return await version_served(stub) == version

    try:
        served = asyncio.run(asyncio.wait_for(main(), 240))
    finally:
        for process in processes.values():
            process.terminate()
            process.wait(30)
    replica_log = logs["inference"].read_text()
    ws_log = logs["weightsync"].read_text()
    assert served == [1, 2]
    assert re.search(r"event=version_announced version=2 transport=collective epoch=\d+ members=1", ws_log), ws_log[
        -2000:
    ]
    # the second version at least went by the broadcast (the first may be a joiner's catch-up pull)
    assert re.search(r"event=weights_applied version=2 transport=collective", replica_log), replica_log[-3000:]
    assert "weights_refused" not in replica_log
