"""Resident staging for broadcast versions: buffers reused across versions, a corrupted version
refused without leaving the group out of step, and a set reused only when nobody reads it."""

import datetime
import threading

import pytest
import torch
import torch.distributed as dist

from shared.engines.base import StagedWeights
from shared.redis_server import free_port
from shared.rpc.steadyrl.v1 import weightsync_pb2 as pb
from shared.weightsync.collective import Staging, receive_version, send_version
from shared.weightsync.manifest import WeightError, describe
from shared.weightsync.subscriber import GrpcWeightSubscriber


def _state(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(300, 7, generator=gen).to(torch.bfloat16), "b": torch.randn(5000, generator=gen),
            "c": torch.randint(0, 100, (64,), generator=gen)}


def test_versions_through_resident_buckets_and_a_corrupted_one_in_between():
    port = free_port()
    transport = pb.Transport(kind=pb.COLLECTIVE, epoch=1, world_size=2, bucket_bytes=8192, backend="gloo",
                             timeout_seconds=30)
    versions = {v: _state(v) for v in (1, 2, 3)}
    manifests = {v: describe(s, v, v - 1) for v, s in versions.items()}
    sent = {**versions, 2: {**versions[2], "b": versions[2]["b"] + 1}}  # version 2's bytes do not match
    results: dict = {}
    pointers: list[list[int]] = []

    def member(rank: int) -> None:
        timeout = datetime.timedelta(seconds=30)
        store = dist.TCPStore("127.0.0.1", port, None, rank == 0, timeout=timeout, wait_for_workers=False)
        group = dist.ProcessGroupGloo(dist.PrefixStore("t/", store), rank, 2, timeout)
        staging = Staging()
        for v in (1, 2, 3):
            if rank == 0:
                results[("sent", v)] = send_version(group, transport, manifests[v], sent[v], staging)
                continue
            try:
                got = receive_version(group, transport, manifests[v], staging=staging)
                results[v] = {k: t.clone() for k, t in got.items()}
            except WeightError as exc:
                results[v] = exc
            pointers.append([b.data_ptr() for b in staging.buffers])

    threads = [threading.Thread(target=member, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    nbytes = sum(t.numel() * t.element_size() for t in versions[1].values())
    assert results[("sent", 1)] == results[("sent", 3)] == nbytes
    assert isinstance(results[2], WeightError) and "tensor b" in str(results[2])
    for v in (1, 3):  # the version after the corrupted one still arrives: the group stayed in step
        assert all(torch.equal(results[v][k], versions[v][k]) for k in versions[v])
    assert len(pointers) == 3 and len(pointers[0]) == 3 and pointers[0] == pointers[1] == pointers[2]


class _Engine(StagedWeights):
    def __init__(self) -> None:
        self._init_weights(0)
        self.loaded: list[int] = []
        self.during: list[bool] = []

    def _load(self, version, state_dict):
        self.during.append(self.holds(version))
        self.loaded.append(version)


def test_an_engine_holds_a_version_while_pending_or_loading_and_not_after():
    engine = _Engine()
    with engine._lock:  # a step runs: the update waits for it
        engine.update_weights(1, {})
        assert engine.holds(1) and not engine.holds(2) and engine.loaded == []
    engine._drain()  # the engine's thread applies it when the step ends
    assert engine.loaded == [1] and engine.during == [True] and not engine.holds(1)


def test_subscriber_alternates_two_staging_sets_and_never_reuses_one_in_use():
    fresh = GrpcWeightSubscriber("127.0.0.1:1", lambda v, sd: None)
    assert fresh._staging_for(1) is not fresh._staging_for(2)  # no in_use: the consumer may keep what it got
    assert fresh.staging == []
    busy: set[int] = set()
    sub = GrpcWeightSubscriber("127.0.0.1:1", lambda v, sd: None, in_use=busy.__contains__)
    a = sub._staging_for(1)
    sub.held = (1, None, [])
    b = sub._staging_for(2)
    assert a is not b
    sub.held = (2, None, [])
    assert sub._staging_for(3) is a  # version 1 is neither held nor in the engine any more
    sub.held = (3, None, [])
    busy.add(2)  # the engine still loads version 2 from set b: version 4 gets buffers of its own
    extra = sub._staging_for(4)
    assert extra is not a and extra is not b and [s for _, s in sub.staging] == [b, a]
    busy.clear()
    assert sub._staging_for(5) is b


@pytest.mark.parametrize("sizes", [[10, 20], [5]])
def test_staging_reallocates_only_when_the_plan_changes(sizes):
    staging = Staging()
    first = staging.buckets(sizes, torch.device("cpu"))
    assert staging.buckets(sizes, torch.device("cpu")) is first
    assert [b.numel() for b in staging.buckets([*sizes, 1], torch.device("cpu"))] == [*sizes, 1]
