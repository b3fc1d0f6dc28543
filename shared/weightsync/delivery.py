"""A version on its way into an engine, whatever carried it: a `Delivery`.

An engine applies a delivery with its generation paused (`Engine.apply`), bucket by bucket, each
bucket's tensors copied into its weights in place: no staged copy of the whole version. A
delivery gives its bytes one of two ways:

- `buckets()`: in this process, an iterator of buckets, each a list of (name, tensor) checked
  against the signed manifest before it is yielded (views of the transport's memory: the shm
  mapping, a collective's ring of two buckets, a pulled tensor);
- `worker_update()`: the `update_info` of vLLM's weight-transfer API, read by the worker-side
  engine registered as `steadyrl` (`shared.weightsync.vllm`), which reads and checks the bytes
  in the worker process itself.

A transport that can fail after some buckets were applied (a collective, a pull) raises
`PartialVersion` once it is done with its peers: the engine then holds neither version and
serves nothing until another version is applied whole (the subscriber restores the previous
one). One that fails before the first bucket raises `WeightError`: the engine keeps serving.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from shared.rpc.steadyrl.v1 import weightsync_pb2 as pb
from shared.weightsync.manifest import WeightError

Bucket = list[tuple[str, torch.Tensor]]
BUCKET_BYTES = 256 << 20  # an in-process bucket: at most this many bytes (a larger tensor goes alone)


class PartialVersion(WeightError):
    """A version failed after some of its buckets were applied."""


class Delivery:
    """One version's manifest and its bytes (`buckets`, or the vLLM worker's `worker_update`)."""

    transport = ""

    def __init__(self, manifest: pb.WeightManifest) -> None:
        self.manifest = manifest

    @property
    def version(self) -> int:
        return self.manifest.version

    def prepare(self) -> None:
        """What can be done before the engine pauses (checking bytes already here); optional."""

    def buckets(self) -> Iterator[Bucket]:
        raise NotImplementedError

    def worker_update(self) -> dict:
        """The update_info the vLLM worker-side engine reads (msgpack-able: str, int, bytes, lists)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the delivery holds (a mapping, a channel); idempotent."""


def as_tensor(data, spec: pb.TensorSpec) -> torch.Tensor:
    """A view of raw bytes (a buffer, or a uint8 tensor) as the manifest entry's tensor."""
    raw = data if isinstance(data, torch.Tensor) else torch.frombuffer(data, dtype=torch.uint8)
    return raw.view(getattr(torch, spec.dtype)).reshape(list(spec.shape))


def batched(tensors: Iterable[tuple[str, torch.Tensor]], limit: int = BUCKET_BYTES) -> Iterator[Bucket]:
    """(name, tensor) pairs grouped into buckets of at most `limit` bytes, in their order."""
    bucket: Bucket = []
    size = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > limit:
            yield bucket
            bucket = []
            size = 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


class StateDictDelivery(Delivery):
    """A version handed in process as a state dict (tests, tools; trusted, so not checked): its
    buckets are its tensors; a vLLM worker gets it through a shared-memory file (`to_shm`)."""

    transport = "state_dict"

    def __init__(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
        super().__init__(pb.WeightManifest(version=version))
        self.state_dict = state_dict

    def buckets(self) -> Iterator[Bucket]:
        yield from batched((name, tensor.detach()) for name, tensor in self.state_dict.items())

    def to_shm(self, path):
        """The same version written to a shared-memory file, as that file's delivery."""
        from shared.weightsync.shm import ShmDelivery, write_shm

        return ShmDelivery(write_shm(path, self.state_dict, self.version, 0), str(path))
