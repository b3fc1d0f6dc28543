"""What a weight transport is, declared once: the trainer's end (`WeightPublisher`), what reaches a replica
(`Delivery`), a replica's watch (`WeightSubscriber`), and the registry of transports by name (`TRANSPORTS`).
Adding a transport is one module and one line here. Light to import (no torch).

A transport that fails after some buckets were applied raises `PartialVersion` (the engine then serves nothing until
a whole version lands); one that fails before the first raises `WeightError` (the engine keeps serving).

Details: docs/internals/weights.md"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import asyncio

    import torch

    from shared.rpc.steadyrl.v1 import weightsync_pb2 as pb

Bucket = list[tuple[str, "torch.Tensor"]]  # or (name, a `patches.Patch`) where the version is a patch
BUCKET_BYTES = 256 << 20  # an in-process bucket: at most this many bytes (a larger tensor goes alone)


class WeightError(ValueError):
    """A manifest, chunk stream or signature that must not become a version."""


class PartialVersion(WeightError):
    """A version failed after some of its buckets were applied."""


class TransportName(StrEnum):
    GRPC = "grpc"  # chunks over weight-sync's Push and Pull
    SHM = "shm"  # a safetensors file in shared memory on the service's host
    COLLECTIVE = "collective"  # a torch.distributed broadcast from the trainer to an epoch's members


class WeightPublisher(ABC):
    """The trainer's side of the weights: each version pushed whole, verified before it is visible."""

    @abstractmethod
    async def push(
        self, tensors: Mapping[str, torch.Tensor], version: int, parent_version: int = 0, timeout: float | None = 600.0
    ): ...

    async def stage(
        self, tensors: Mapping[str, torch.Tensor], version: int, parent_version: int = 0, timeout: float | None = 600.0
    ) -> Callable[[], Awaitable[Any]]:
        """The part of a push that reads `tensors`; returns what completes it, awaited later (the
        tensors free to change meanwhile; one completion before the next stage). By default the
        whole push: a transport that sends while it reads (grpc, collective) has nothing left."""
        reply = await self.push(tensors, version, parent_version, timeout)

        async def sent():
            return reply

        return sent

    @abstractmethod
    async def close(self) -> None: ...


class Delivery(ABC):
    """One version's manifest and its bytes (`buckets`, or the vLLM worker's `worker_update`)."""

    transport = ""

    def __init__(self, manifest: pb.WeightManifest) -> None:
        self.manifest = manifest

    @property
    def version(self) -> int:
        return self.manifest.version

    def prepare(self) -> None:  # noqa: B027 - optional: most deliveries have nothing to do early
        """What can be done before the engine pauses (checking bytes already here); optional."""

    @abstractmethod
    def buckets(self) -> Iterator[Bucket]: ...

    @abstractmethod
    def worker_update(self) -> dict:
        """What the vLLM worker's reader needs (msgpack-able: str, int, bytes, lists); its
        `transport` names the reader."""

    def close(self) -> None:  # noqa: B027 - optional: most deliveries hold nothing
        """Release what the delivery holds (a mapping, a channel); idempotent."""


class WeightSubscriber(ABC):
    """A replica's side: every new version, as a delivery its engine applies (every tensor checked
    against the signed manifest first); resumes after a drop."""

    @property
    @abstractmethod
    def version(self) -> int:
        """The version the engine serves (0 before the first)."""

    @abstractmethod
    async def run(self, stop: asyncio.Event | None = None) -> None: ...


@dataclass(frozen=True)
class PublishOptions:
    signer: Any = None  # a signing.Signer: only the trainer has one
    max_message_bytes: int | None = None
    shm_dir: Path | None = None  # shm: where the version files go
    shm_keep: int = 4  # shm: version files kept
    patches: bool = False  # shm, collective: a tensor travels as its changed elements where that is smaller


class Transport(ABC):
    """One transport's ends: the trainer's publisher, the replica's delivery of an announced
    version, and the reader a vLLM worker runs on `Delivery.worker_update()`."""

    name: TransportName

    @property
    def kind(self) -> int:
        """Its `WeightTransportKind` on the wire."""
        from shared.rpc.steadyrl.v1 import weightsync_pb2 as pb

        return pb.WeightTransportKind.Value(self.name.upper())

    @abstractmethod
    def publisher(self, grpc, options: PublishOptions) -> WeightPublisher:
        """The trainer's end, over `grpc` (the `GrpcWeightPublisher` every transport announces through)."""

    @abstractmethod
    def delivery(self, announcement: pb.VersionAnnouncement, subscriber) -> Delivery:
        """A replica's delivery of an announced version (`subscriber`: its `WatchSubscriber`)."""

    @abstractmethod
    def worker_buckets(self, update, manifest: pb.WeightManifest, worker) -> Iterator[Bucket]:
        """In a vLLM worker: the version's buckets from its `update` (the delivery's
        `worker_update`), each checked against `manifest`; `worker`: the worker's receiver."""


TRANSPORTS: dict[TransportName, str] = {
    TransportName.GRPC: "shared.weightsync.grpc:TRANSPORT",
    TransportName.SHM: "shared.weightsync.shm:TRANSPORT",
    TransportName.COLLECTIVE: "shared.weightsync.collective:TRANSPORT",
}


def transport(name: str) -> Transport:
    """The transport called `name` (ValueError naming the known ones)."""
    try:
        module, attribute = TRANSPORTS[TransportName(name)].split(":")
    except ValueError:
        raise ValueError(f"unknown weight transport {name!r}; one of {[str(t) for t in TRANSPORTS]}") from None
    return getattr(importlib.import_module(module), attribute)


def transport_of_kind(kind: int) -> Transport:
    """The transport of a `WeightTransportKind` on the wire."""
    from shared.rpc.steadyrl.v1 import weightsync_pb2 as pb

    return transport(pb.WeightTransportKind.Name(kind).lower())


def as_tensor(data, spec: pb.TensorSpec) -> torch.Tensor:
    """A view of raw bytes (a buffer, or a uint8 tensor) as the manifest entry's tensor."""
    import torch

    raw = data if isinstance(data, torch.Tensor) else torch.frombuffer(data, dtype=torch.uint8)
    return raw.view(getattr(torch, spec.dtype)).reshape(list(spec.shape))


def batched(tensors: Iterable[tuple[str, torch.Tensor]], limit: int = BUCKET_BYTES) -> Iterator[Bucket]:
    """(name, tensor) pairs grouped into buckets of at most `limit` bytes, in their order."""
    bucket: Bucket = []
    size = 0
    for name, tensor in tensors:
        nbytes = tensor.nbytes  # a tensor's, or a patch's
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
    buckets are its tensors; a vLLM engine writes it to a shared-memory file first
    (`shm.write_shm`) and hands the worker that file's delivery."""

    transport = "state_dict"

    def __init__(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
        from shared.rpc.steadyrl.v1 import weightsync_pb2 as pb

        super().__init__(pb.WeightManifest(version=version))
        self.state_dict = state_dict

    def buckets(self) -> Iterator[Bucket]:
        yield from batched((name, tensor.detach()) for name, tensor in self.state_dict.items())

    def worker_update(self) -> dict:
        raise WeightError("an in-process state dict reaches a vLLM worker as a shared-memory file")


def kind(manifest) -> str:
    """What a version is (its `WeightManifest`): `adapter` (a LoRA adapter over its base) or `full`
    (whole weights)."""
    return "adapter" if manifest.HasField("adapter") else "full"


# The dtypes a version's tensors may have, by their torch name: their bytes per element and their
# safetensors code (a version is spilled to, and mapped from, a safetensors file: `shm.ST_DTYPES`). A
# manifest is checked against it without importing torch (tests/unit/test_weights.py holds it to torch's).
WEIGHT_DTYPES: dict[str, tuple[int, str]] = {
    "float32": (4, "F32"),
    "bfloat16": (2, "BF16"),
    "float16": (2, "F16"),
    "float64": (8, "F64"),
    "int64": (8, "I64"),
    "int32": (4, "I32"),
    "int16": (2, "I16"),
    "int8": (1, "I8"),
    "uint8": (1, "U8"),
    "bool": (1, "BOOL"),
}
