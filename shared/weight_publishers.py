"""The trainer's side of each weight transport (`shared.interfaces.WeightPublisher`), chosen by
configuration: `grpc` pushes the bytes to the weight-sync service (`GrpcWeightPublisher`), `shm`
writes them to a shared-memory file and announces it, `collective` announces the version and
broadcasts it to the current epoch's group. Every transport announces the signed manifest to the
service first; a collective that fails falls back to a gRPC push of the same version, so the
service always ends up holding it (a replica that missed it pulls it from there)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from pathlib import Path

import grpc
import torch

from shared.interfaces import WeightPublisher
from shared.rpc.steadyrl.v1 import weightsync_pb2 as pb
from shared.weight_transport import Groups, Staging, prune_shm, send_version, write_shm
from shared.weights import describe
from shared.weightsync_client import GrpcWeightPublisher

log = logging.getLogger("steadyrl.weightsync.client")
TRANSPORTS = ("grpc", "shm", "collective")


class ShmWeightPublisher(WeightPublisher):
    """Each version written once to `directory/v<version>.safetensors` (digests taken as it is
    written), then announced; the newest `keep` files are kept."""

    def __init__(self, grpc_publisher: GrpcWeightPublisher, directory: Path, keep: int = 4) -> None:
        self.grpc, self.directory, self.keep = grpc_publisher, directory, keep

    async def push(self, tensors: Mapping[str, torch.Tensor], version: int, parent_version: int = 0,
                   timeout: float | None = 600.0) -> pb.AnnounceReply:
        path = self.directory / f"v{version}.safetensors"
        manifest = await asyncio.to_thread(write_shm, path, tensors, version, parent_version, self.grpc.key)
        reply = await self.grpc.stub.Announce(pb.AnnounceRequest(
            manifest=manifest, transport=pb.Transport(kind=pb.SHM, shm_path=str(path))),
            wait_for_ready=True, timeout=timeout)
        prune_shm(self.directory, self.keep)
        return reply

    async def close(self) -> None:
        await self.grpc.close()


class CollectiveWeightPublisher(WeightPublisher):
    """Announce, then broadcast from rank 0 to the epoch's group (gloo for CPU tensors, nccl for
    CUDA ones), every wait bounded by the service's collective timeout."""

    def __init__(self, grpc_publisher: GrpcWeightPublisher) -> None:
        self.grpc = grpc_publisher
        self.groups = Groups()
        self.staging = Staging()  # the buckets are filled from the tensors each version: one set serves all

    async def push(self, tensors: Mapping[str, torch.Tensor], version: int, parent_version: int = 0,
                   timeout: float | None = 600.0):
        manifest = await asyncio.to_thread(describe, tensors, version, parent_version, self.grpc.key)
        first = tensors[next(iter(tensors))]
        backend = "nccl" if first.device.type == "cuda" else "gloo"
        reply = await self.grpc.stub.Announce(pb.AnnounceRequest(
            manifest=manifest, transport=pb.Transport(kind=pb.COLLECTIVE, backend=backend)),
            wait_for_ready=True, timeout=timeout)
        transport = reply.transport
        try:
            def broadcast() -> int:
                return send_version(self.groups.get(transport, 0), transport, manifest, tensors, self.staging)

            await asyncio.to_thread(broadcast)
        except Exception as exc:  # noqa: BLE001 - a member died or stalled: the epoch ends, gRPC carries it
            self.groups.drop()
            log.warning("event=collective_failed version=%d epoch=%d error=%s fallback=grpc", version,
                        transport.epoch, exc)
            with contextlib.suppress(grpc.aio.AioRpcError):
                await self.grpc.stub.Report(pb.TransferReport(version=version, epoch=transport.epoch, ok=False,
                                                              error=str(exc)[:500]), timeout=10)
            return await self.grpc.push(tensors, version, parent_version, timeout)
        if backend == "nccl":  # the service (a CPU process) is no member: it keeps the version from a push
            return await self.grpc.push(tensors, version, parent_version, timeout)
        return reply

    async def close(self) -> None:
        await self.grpc.close()


def make_publisher(kind: str, address: str, key: bytes | None = None, max_message_bytes: int | None = None,
                   shm_dir: Path | None = None, shm_keep: int = 4) -> WeightPublisher:
    """The publisher of a transport by name (`TRANSPORTS`)."""
    options = {"max_message_bytes": max_message_bytes} if max_message_bytes else {}
    base = GrpcWeightPublisher(address, key=key, **options)
    if kind == "grpc":
        return base
    if kind == "shm":
        if shm_dir is None:
            raise ValueError("the shm transport needs a directory in shared memory")
        return ShmWeightPublisher(base, shm_dir, shm_keep)
    if kind == "collective":
        return CollectiveWeightPublisher(base)
    raise ValueError(f"unknown weight transport {kind!r}; one of {TRANSPORTS}")
