"""Patch versions end to end: a real weight-sync service, the trainer's shm publisher with patches, and replicas'
torch engines watching it. Over 50 versions each replica's weights equal the published bytes bit for bit after
every version; a replica that restarted, missed versions, or holds its weights in another dtype takes whole
versions from the service, never a patch against bytes it does not hold; a tampered patch is refused."""

import asyncio

import pytest
import torch

from shared.engines import make_engine
from shared.models import load_causal_lm
from shared.weightsync import make_publisher
from shared.weightsync.grpc import GrpcDelivery
from shared.weightsync.manifest import CastView, WeightError, tensor_to_bytes
from shared.weightsync.signing import Verifier
from shared.weightsync.subscriber import WatchSubscriber
from tests.integration.test_weightsync import Server

VERSIONS = 50


def published(master: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {name: bytes(tensor_to_bytes(tensor)) for name, tensor in CastView(master, torch.bfloat16).items()}


def held(engine) -> dict[str, bytes]:
    return {name: bytes(tensor_to_bytes(t.to(torch.bfloat16))) for name, t in engine.model.state_dict().items()}


def step(master: dict[str, torch.Tensor], version: int, gen: torch.Generator) -> None:
    """What a trainer's small step does to its fp32 master (most bf16 elements stay the same); every
    tenth version one tensor in the middle moves everywhere (it goes whole, after patches in its bucket)."""
    for tensor in master.values():
        tensor.add_(2e-5 * torch.randn(tensor.shape, generator=gen).sign())
    if version % 10 == 0:
        master[dense_of(master)].mul_(1.01)


def dense_of(state: dict) -> str:
    return list(state)[len(state) // 2]


def subscriber(server: Server, engine, key, kind: str, version: int = 0, refuses: int = 0) -> WatchSubscriber:
    async def apply(delivery) -> float:
        if delivery.version == refuses:  # an engine that cannot take this version, however it comes
            raise WeightError(f"version {refuses} refused by the engine")
        return await asyncio.to_thread(engine.apply, delivery)

    return WatchSubscriber(
        server.address,
        apply,
        f"replica-{id(engine)}",
        transports=[kind, "grpc"],
        base=engine.weight_bytes,
        patchable=engine.takes_patch,  # as services/inference passes it
        version=version,
        verifier=Verifier.from_file(key),
    )


async def gone(task: asyncio.Task) -> None:
    """A subscriber stopped as a replica's process ends: its watch cut wherever it is."""
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def until(condition, seconds: float = 30.0) -> None:
    async def wait() -> None:
        while not condition():
            await asyncio.sleep(0.005)

    await asyncio.wait_for(wait(), seconds)  # a bound on the wait, never a measure of speed


@pytest.mark.parametrize("kind", ["shm", "collective"])
def test_fifty_patch_versions_are_bit_exact_and_a_replica_holding_other_bytes_takes_them_whole(
    tmp_path, tiny_model_dir, kind
):
    master = {k: v.detach().clone() for k, v in load_causal_lm(tiny_model_dir, "float32").state_dict().items()}
    a = make_engine("torch", str(tiny_model_dir), "bfloat16")  # watches every version
    b = make_engine("torch", str(tiny_model_dir), "bfloat16")  # restarted, and away for versions
    c = make_engine("torch", str(tiny_model_dir), "float32")  # holds its weights in another dtype than published
    gen = torch.Generator().manual_seed(0)

    async def main():
        # two versions retained: the fewest that hold a patch version and its base
        server = Server(tmp_path, shm_dir=tmp_path / "shm", collective_timeout_seconds=20, retain_versions=2)
        await server.start()
        public = server.settings.verify_key_file
        subs = {
            "a": subscriber(server, a, public, kind),
            "b": subscriber(server, b, public, kind),
            "c": subscriber(server, c, public, kind),
        }
        tasks = {name: asyncio.create_task(s.run()) for name, s in subs.items()}
        await until(lambda: len(server.servicer.members.subscribers) == 3)  # all watching before version 1
        publisher = make_publisher(kind, server.address, server.signer, shm_dir=tmp_path / "shm" / "run", patches=True)
        sent, expected, mismatched = {}, {}, {"a": [], "b": [], "c": []}
        try:
            for version in range(1, VERSIONS + 1):
                if version > 1:
                    step(master, version, gen)
                if version == 21:  # b restarts: a new watch, its engine still at version 20 (no manifest known)
                    await gone(tasks["b"])
                    await until(lambda: len(server.servicer.members.subscribers) == 2)
                    subs["b"] = subscriber(server, b, public, kind, version=20, refuses=41 if kind == "shm" else 0)
                    tasks["b"] = asyncio.create_task(subs["b"].run())
                    await until(lambda: len(server.servicer.members.subscribers) == 3)  # before 21 is announced
                if version == 31:  # b's stream goes away for versions 31-33
                    await gone(tasks["b"])
                if version == 34:  # back: the newest version (33) first, by a gRPC pull against the bytes it holds
                    tasks["b"] = asyncio.create_task(subs["b"].run())
                    await until(lambda: subs["b"].version == 33)
                before = sent_bytes()
                await publisher.push(CastView(master, torch.bfloat16), version, version - 1, timeout=60)
                sent[version] = [after - was for after, was in zip(sent_bytes(), before, strict=True)]
                expected[version] = published(master)
                live = {"a": version, "c": version} | ({} if 31 <= version <= 33 else {"b": version})
                if (
                    version == 41 and kind == "shm"
                ):  # b refused it: it serves 40, and the patch 42 is against bytes it does not hold
                    live["b"] = 40
                    await until(lambda: 41 in subs["b"].refused)
                await until(lambda: all(subs[n].version == v for n, v in live.items()))  # noqa: B023
                for name, served in live.items():
                    if held({"a": a, "b": b, "c": c}[name]) != expected[served]:
                        mismatched[name].append(version)
            whole = GrpcDelivery(server.address, VERSIONS)  # the service made the last patch version whole
            pulled = await asyncio.to_thread(lambda: {spec.name: bytes(data) for spec, data in whole.tensors()})
        finally:
            for task in tasks.values():
                await gone(task)
            await publisher.close()
            await server.stop()
        return subs, mismatched, pulled, expected, sent

    subs, mismatched, pulled, expected, sent = asyncio.run(asyncio.wait_for(main(), 240))
    assert mismatched == {"a": [], "b": [], "c": []}  # every replica, after every version, bit for bit
    assert pulled == expected[VERSIONS]
    a_sub, b_sub, c_sub = subs["a"], subs["b"], subs["c"]
    assert a_sub.received == {kind: VERSIONS} and a_sub.whole == 0  # every patch applied in place
    # b restarted at 20: version 21 whole (no manifest of what it holds), then patches; after its stream came
    # back at 34, the newest (33) by a gRPC pull against the bytes it held, then patches; (shm) 41 refused, so
    # 42 (a patch against 41) whole, then patches again
    if kind == "shm":
        assert b_sub.whole == 2 and b_sub.received == {"grpc": 3, kind: (30 - 22 + 1) + (40 - 34 + 1) + (50 - 43 + 1)}
    else:
        assert b_sub.whole == 1 and b_sub.received == {"grpc": 2, kind: (30 - 22 + 1) + (50 - 34 + 1)}
    assert c_sub.whole == VERSIONS - 1 and c_sub.received == {kind: 1, "grpc": VERSIONS - 1}
    model = sum(len(data) for data in expected[VERSIONS].values())
    assert sent[1] == [model, 0]  # the first version whole; then (full, patch) bytes of each
    dense = dense_of(expected[VERSIONS])
    for version in range(2, VERSIONS + 1):
        full, patch = sent[version]
        assert full == (len(expected[VERSIONS][dense]) if version in whole_versions() else 0), version
        assert 0 < patch < 0.2 * model, version


def whole_versions() -> set[int]:
    """The versions the tensor moved everywhere every tenth version goes whole: those, and the
    DENSE_REST versions after each (uncompared), unless a tenth comes again first."""
    from shared.weightsync.patches import DENSE_REST

    out, resting = set(), 0
    for version in range(2, VERSIONS + 1):
        if resting:
            resting -= 1
            out.add(version)
        elif version % 10 == 0:
            out.add(version)
            resting = DENSE_REST
    return out


def sent_bytes() -> tuple[float, float]:
    from prometheus_client import REGISTRY

    return tuple(
        REGISTRY.get_sample_value("steadyrl_weights_bytes_total", {"kind": k}) or 0.0 for k in ("full", "patch")
    )
