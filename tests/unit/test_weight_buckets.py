"""A version bucket by bucket: through a broadcast's ring of two resident buffers (a bad bucket
refused without leaving the group out of step: WeightError when it is the first, PartialVersion
after one was applied), and into a model's own tensors in place."""

import datetime
import threading

import pytest
import torch
import torch.distributed as dist

from shared.engines.torch_weights import InPlaceWeights
from shared.rpc.steadyrl.v1 import weightsync_pb2 as pb
from shared.runstore.redis_server import free_port
from shared.weightsync.base import Delivery, PartialVersion, StateDictDelivery
from shared.weightsync.collective import Staging, receive_buckets, send_version
from shared.weightsync.manifest import WeightError, describe


def _state(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "a": torch.randn(300, 7, generator=gen).to(torch.bfloat16),
        "b": torch.randn(5000, generator=gen),
        "c": torch.randint(0, 100, (64,), generator=gen),
    }


def test_versions_through_a_ring_of_two_buckets_and_bad_ones_in_between():
    port = free_port()
    # buckets of 8 KiB: a (4200 B) alone, then b (20000 B) alone, then c (512 B)
    transport = pb.Transport(
        kind=pb.COLLECTIVE, epoch=1, world_size=2, bucket_bytes=8192, backend="gloo", timeout_seconds=30
    )
    versions = {v: _state(v) for v in (1, 2, 3, 4)}
    manifests = {v: describe(s, v, v - 1) for v, s in versions.items()}
    sent = {
        **versions,
        2: {**versions[2], "b": versions[2]["b"] + 1},  # version 2: its second bucket is bad
        3: {**versions[3], "a": versions[3]["a"] + 1},
    }  # version 3: its first
    results: dict = {}
    pointers: list[list[int]] = []

    def member(rank: int) -> None:
        timeout = datetime.timedelta(seconds=30)
        store = dist.TCPStore("127.0.0.1", port, None, rank == 0, timeout=timeout, wait_for_workers=False)
        group = dist.ProcessGroupGloo(dist.PrefixStore("t/", store), rank, 2, timeout)
        ring = Staging()
        for v in (1, 2, 3, 4):
            if rank == 0:
                results[("sent", v)] = send_version(group, transport, manifests[v], sent[v], ring)
                continue
            got: dict[str, torch.Tensor] = {}
            try:
                for bucket in receive_buckets(group, transport, manifests[v], ring):
                    got.update((k, t.clone()) for k, t in bucket)  # applied before the next is asked for
                results[v] = got
            except WeightError as exc:
                results[v] = (exc, sorted(got))
            pointers.append([b.data_ptr() for b in ring.buffers])

    threads = [threading.Thread(target=member, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    nbytes = sum(t.numel() * t.element_size() for t in versions[1].values())
    assert results[("sent", 1)] == results[("sent", 4)] == nbytes
    error, applied = results[2]
    assert isinstance(error, PartialVersion) and "tensor b" in str(error) and applied == ["a"]
    error, applied = results[3]
    assert type(error) is WeightError and "tensor a" in str(error) and applied == []
    for v in (1, 4):  # the versions after the bad ones still arrive whole: the group stayed in step
        assert all(torch.equal(results[v][k], versions[v][k]) for k in versions[v])
    # two slots of the largest bucket (20,000 B), the same memory version after version
    assert len(pointers) == 4 and len(pointers[0]) == 2 and all(p == pointers[0] for p in pointers)


class _Failing(Delivery):
    """The version's buckets, a bad one at `bad` (0: the first)."""

    def __init__(self, version: int, state: dict[str, torch.Tensor], bad: int) -> None:
        super().__init__(pb.WeightManifest(version=version))
        self.state = state
        self.bad = bad

    def buckets(self):
        for i, item in enumerate(self.state.items()):
            if i == self.bad:
                raise (PartialVersion if i else WeightError)(f"bucket {i}")
            yield [item]

    def worker_update(self) -> dict:
        raise WeightError("in process only")


def test_a_version_goes_into_the_models_own_tensors_in_place():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    weights = InPlaceWeights(model, [], "none")
    storage = {n: t.data_ptr() for n, t in model.state_dict().items()}
    new = {n: torch.full_like(t, i + 1.0) for i, (n, t) in enumerate(model.state_dict().items())}
    weights.copy_in(StateDictDelivery(1, new))
    assert all(torch.equal(model.state_dict()[n], new[n]) for n in new)
    assert {n: t.data_ptr() for n, t in model.state_dict().items()} == storage  # in place, no new tensors
    before = {n: t.clone() for n, t in model.state_dict().items()}
    with pytest.raises(WeightError) as refused:  # the first bucket bad: nothing changed
        weights.copy_in(_Failing(2, {n: t * 2 for n, t in new.items()}, bad=0))
    assert type(refused.value) is WeightError and all(torch.equal(model.state_dict()[n], before[n]) for n in before)
    with pytest.raises(PartialVersion):  # the third bad: two tensors of version 3 landed
        weights.copy_in(_Failing(3, {n: t * 3 for n, t in new.items()}, bad=2))
    changed = [n for n in before if not torch.equal(model.state_dict()[n], before[n])]
    assert changed == ["0.weight", "0.bias"]
    with pytest.raises(PartialVersion, match="left out"):  # a version missing a tensor is not whole
        weights.copy_in(StateDictDelivery(4, {n: t for n, t in new.items() if n != "1.bias"}))
    with pytest.raises(WeightError, match="not in the model"):
        weights.copy_in(StateDictDelivery(5, {"nope": torch.zeros(1)}))


@pytest.mark.parametrize("sizes", [[10, 20], [5]])
def test_staging_reallocates_only_when_the_plan_changes(sizes):
    staging = Staging()
    first = staging.buckets(sizes, torch.device("cpu"))
    assert staging.buckets(sizes, torch.device("cpu")) is first
    assert [b.numel() for b in staging.buckets([*sizes, 1], torch.device("cpu"))] == [*sizes, 1]
