"""The `collective` transport: the trainer's publishing rank broadcasts the version, in buckets, to
the members of a group — the weight-sync service (which keeps every version for gRPC pulls) and
the replicas that joined. Groups are torch.distributed process groups (gloo on CPU, nccl on GPU)
formed per *membership epoch* through the epoch's rendezvous at the service (`RendezvousStore`:
its authenticated gRPC methods, a key space only the epoch's members learn); forming and
broadcasting are bounded by a timeout, so a member that dies costs the trainer one timeout at
most. A collective that fails falls back to a gRPC push of the same version."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
from collections.abc import Iterator, Mapping

import grpc
import torch
import torch.distributed as dist

from shared.rpc.steadyrl.v1 import weightsync_pb2 as pb
from shared.rpc.steadyrl.v1 import weightsync_pb2_grpc
from shared.weightsync.base import (
    Bucket,
    Delivery,
    PartialVersion,
    PublishOptions,
    Transport,
    TransportName,
    WeightError,
    WeightPublisher,
    as_tensor,
)
from shared.weightsync.grpc import GrpcWeightPublisher
from shared.weightsync.manifest import PIECE_BYTES, describe, digest, pieces
from shared.weightsync.patches import Patch, PatchEncoder, count_bytes, encode_version, patch_manifest, wire_nbytes

log = logging.getLogger("steadyrl.weightsync.client")


def buckets(manifest: pb.WeightManifest, bucket_bytes: int) -> list[list[int]]:
    """Tensor indices of each broadcast bucket: manifest order, at most `bucket_bytes` per bucket
    (a larger tensor is a bucket of its own). Every member computes the same plan."""
    plan: list[list[int]] = [[]]
    used = 0
    for index, spec in enumerate(manifest.tensors):
        if plan[-1] and used + wire_nbytes(spec) > bucket_bytes:
            plan.append([])
            used = 0
        plan[-1].append(index)
        used += wire_nbytes(spec)
    return [b for b in plan if b]


class RendezvousStore(dist.Store):
    """A torch.distributed store over one collective epoch's rendezvous at the weight-sync service
    (`services/weightsync/rendezvous.py`): the group's members exchange their addresses there, in
    a key space only they know, behind the deployment's token — no store port anyone can reach.
    `rendezvous` is either the service's own `Rendezvous` (rank 1, in its process) or the
    service's address (every other member, through its gRPC methods)."""

    def __init__(self, rendezvous, transport: pb.Transport) -> None:
        super().__init__()
        self.epoch = transport.epoch
        self.name = transport.rendezvous
        self.seconds = transport.timeout_seconds or 60
        self.local = None if isinstance(rendezvous, str) else rendezvous
        self.channel = self.stubs = None
        if self.local is None:
            from shared.rpc import channel_options
            from shared.rpc.auth import token_from_env
            from shared.rpc.tls import sync_channel, tls_from_env

            self.channel = sync_channel(rendezvous, options=channel_options(), tls=tls_from_env())
            token = token_from_env()
            self.metadata = [("authorization", f"Bearer {token}")] if token else None
            self.stubs = weightsync_pb2_grpc.WeightSyncStub(self.channel)

    def _key(self, key: str, value: bytes = b"", timeout: float = 0.0) -> pb.RendezvousKey:
        return pb.RendezvousKey(epoch=self.epoch, rendezvous=self.name, key=key, value=value, timeout_seconds=timeout)

    def set(self, key: str, value) -> None:
        value = value.encode() if isinstance(value, str) else bytes(value)
        if self.local is not None:
            return self.local.put(self.epoch, self.name, key, value)
        self.stubs.RendezvousPut(self._key(key, value), metadata=self.metadata, timeout=self.seconds)

    def get(self, key: str) -> bytes:
        if self.local is not None:
            return self.local.wait(self.epoch, self.name, key, self.seconds)
        reply = self.stubs.RendezvousWait(
            self._key(key, timeout=self.seconds), metadata=self.metadata, timeout=self.seconds + 5
        )
        return reply.value

    def add(self, key: str, amount: int) -> int:
        if self.local is not None:
            return self.local.add(self.epoch, self.name, key, amount)
        reply = self.stubs.RendezvousAdd(
            self._key(key, str(amount).encode()), metadata=self.metadata, timeout=self.seconds
        )
        return int(reply.value)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        for key in keys:
            self.get(key)

    def check(self, keys: list[str]) -> bool:
        if self.local is not None:
            return all(self.local._get(self.epoch, self.name, key) is not None for key in keys)
        try:
            for key in keys:
                self.stubs.RendezvousWait(self._key(key, timeout=0.0), metadata=self.metadata, timeout=self.seconds)
        except grpc.RpcError:
            return False
        return True

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.seconds = timeout.total_seconds()


class Groups:
    """One member's process groups, one per membership epoch, formed through the epoch's
    rendezvous at the weight-sync service (`rendezvous`: its address, or in the service itself its
    `Rendezvous`) within the transport's timeout. Only the newest epoch is kept."""

    def __init__(self, rendezvous="") -> None:
        self.rendezvous = rendezvous
        self.epoch: int | None = None
        self.group = None

    def get(self, transport: pb.Transport, rank: int):
        if self.epoch == transport.epoch and self.group is not None:
            return self.group
        timeout = datetime.timedelta(seconds=transport.timeout_seconds or 60)
        store = RendezvousStore(self.rendezvous, transport)
        self.group = None
        self.epoch = None
        if transport.backend == "nccl":
            group = dist.ProcessGroupNCCL(store, rank, transport.world_size, dist.ProcessGroupNCCL.Options())
        else:
            group = dist.ProcessGroupGloo(store, rank, transport.world_size, timeout)
        self.group = group
        self.epoch = transport.epoch
        return group

    def drop(self) -> None:
        self.group = None
        self.epoch = None


def _device(transport: pb.Transport) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if transport.backend == "nccl" else torch.device("cpu")


class Staging:
    """Resident bucket buffers reused version after version (a ring of two on either end): a
    broadcast into fresh memory runs ~4× slower here (every page faulted in while the bytes
    arrive: 1.4 vs 7.6 GiB/s)."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []

    def buckets(self, sizes: list[int], device: torch.device) -> list[torch.Tensor]:
        if [b.numel() for b in self.buffers] != sizes or any(b.device != device for b in self.buffers):
            self.buffers = [torch.empty(n, dtype=torch.uint8, device=device) for n in sizes]
            for buffer in self.buffers:
                buffer.fill_(0)  # fault the pages in now, not while bytes arrive
        return self.buffers


def _plan(manifest: pb.WeightManifest, transport: pb.Transport) -> tuple[list[list[int]], list[int]]:
    plan = buckets(manifest, transport.bucket_bytes)
    return plan, [sum(wire_nbytes(manifest.tensors[i]) for i in b) for b in plan]


def _options(transport: pb.Transport):
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.timeout = datetime.timedelta(seconds=transport.timeout_seconds or 60)
    return options


def send_version(
    group,
    transport: pb.Transport,
    manifest: pb.WeightManifest,
    tensors: Mapping[str, torch.Tensor],
    staging: Staging | None = None,
) -> int:
    """Rank 0: broadcast the version bucket by bucket through a ring of two buckets (the next is
    filled while the last one travels); returns the bytes sent."""
    plan, sizes = _plan(manifest, transport)
    ring = (staging or Staging()).buckets([max(sizes, default=0)] * min(2, len(sizes)), _device(transport))
    names = [spec.name for spec in manifest.tensors]
    scratch = torch.empty(PIECE_BYTES, dtype=torch.uint8)
    pending = None
    for index, indices in enumerate(plan):
        bucket = ring[index % 2][: sizes[index]]  # two buckets' worth, not a second copy of the model
        at = 0
        for i in indices:
            start = at
            if bucket.device.type == "cpu":  # cast a piece at a time into the bucket (`pieces`)
                for piece in pieces(tensors, names[i], scratch):
                    bucket[at : at + len(piece)].copy_(torch.frombuffer(piece, dtype=torch.uint8))
                    at += len(piece)
            else:
                tensor = tensors[names[i]].detach().contiguous().reshape(-1).view(torch.uint8)
                bucket[at : at + tensor.numel()].copy_(tensor)
            at = start + wire_nbytes(manifest.tensors[i])  # a patch's slot is padded to 8 bytes
        if pending is not None:
            pending.wait()
        pending = group.broadcast([bucket], _options(transport))
    if pending is not None:
        pending.wait()
    return sum(sizes)


def receive_buckets(
    group, transport: pb.Transport, manifest: pb.WeightManifest, ring: Staging | None = None
) -> Iterator[Bucket]:
    """A member: the version's buckets as they arrive, through a ring of two resident buffers
    (the next bucket arrives while the one yielded is applied, so apply each before asking for
    the next). Each is checked against the manifest before it is yielded. A bad bucket stops the
    yielding but not the receiving — the group stays in step for the next version — and then
    raises: WeightError if it was the first, PartialVersion after some were yielded."""
    plan, sizes = _plan(manifest, transport)
    slots = (ring or Staging()).buckets([max(sizes, default=0)] * min(2, len(sizes)), _device(transport))
    works = {0: group.broadcast([slots[0][: sizes[0]]], _options(transport))} if sizes else {}
    bad = ""
    yielded = 0
    for index, indices in enumerate(plan):
        works.pop(index).wait()
        if index + 1 < len(plan):  # its slot held bucket index - 1, applied already
            works[index + 1] = group.broadcast([slots[(index + 1) % 2][: sizes[index + 1]]], _options(transport))
        if not bad:
            bucket, bad = _checked(slots[index % 2][: sizes[index]], [manifest.tensors[i] for i in indices])
            if not bad:
                yield bucket
                yielded += 1
    if bad:
        raise (PartialVersion if yielded else WeightError)(bad)


def _checked(data: torch.Tensor, specs: list) -> tuple[Bucket, str]:
    """A received bucket's tensors (views of `data`) and "" — or what failed its digest."""
    host = data.cpu() if data.device.type != "cpu" else data
    bucket = []
    at = 0
    for spec in specs:
        patched = spec.HasField("patch")
        size = spec.patch.nbytes if patched else spec.nbytes
        view = memoryview(host[at : at + size].numpy())
        if digest(view) != (spec.patch.checksum if patched else spec.checksum):
            return [], f"tensor {spec.name}: checksum mismatch"
        if patched:  # its changed elements: the member applies them to its base's bytes
            bucket.append((spec.name, Patch(spec, host[at : at + size].numpy())))
        else:
            bucket.append((spec.name, as_tensor(data[at : at + size], spec)))
        at += wire_nbytes(spec)
    return bucket, ""


class CollectiveDelivery(Delivery):
    """A version broadcast to this member: received (in process: `buckets`; in a vLLM worker, which
    joins the group itself: `worker_update`) bucket by bucket, each checked as it arrives."""

    transport = TransportName.COLLECTIVE

    def __init__(
        self, manifest: pb.WeightManifest, transport: pb.Transport, groups: Groups, ring: Staging | None = None
    ) -> None:
        super().__init__(manifest)
        self.spec = transport
        self.groups = groups
        self.ring = ring

    def buckets(self) -> Iterator[Bucket]:
        try:
            yield from receive_buckets(self.groups.get(self.spec, self.spec.rank), self.spec, self.manifest, self.ring)
        except Exception:
            self.groups.drop()  # a failed epoch is not joined again
            raise

    def worker_update(self) -> dict:
        return {
            "transport": str(self.transport),
            "spec": self.spec.SerializeToString(),
            "manifest": self.manifest.SerializeToString(),
            "address": self.groups.rendezvous,
        }


class CollectiveWeightPublisher(WeightPublisher):
    """Announce, then broadcast from rank 0 to the epoch's group (gloo for CPU tensors, nccl for
    CUDA ones), every wait bounded by the service's collective timeout."""

    def __init__(self, grpc_publisher: GrpcWeightPublisher, patches: bool = False) -> None:
        self.grpc = grpc_publisher
        self.groups = Groups(grpc_publisher.address)
        self.staging = Staging()  # the buckets are filled from the tensors each version: one set serves all
        self.encoder = PatchEncoder() if patches else None  # patches: the last version published, kept

    async def push(
        self, tensors: Mapping[str, torch.Tensor], version: int, parent_version: int = 0, timeout: float | None = 600.0
    ):
        device = getattr(tensors, "device", None) or tensors[next(iter(tensors))].device
        if self.encoder is None or device.type == "cuda":  # nccl: weight-sync keeps a whole push of it
            return await self._push(tensors, tensors, version, parent_version, timeout)
        try:
            base, specs, payloads = await asyncio.to_thread(encode_version, tensors, self.encoder)
            self.encoder.version = version
            manifest = patch_manifest(tensors, version, parent_version, base, specs, self.grpc.signer)
            return await self._push(tensors, payloads, version, parent_version, timeout, manifest)
        except BaseException:
            self.encoder.reset()  # not out for sure: the next version goes whole
            raise

    async def _push(
        self,
        tensors: Mapping[str, torch.Tensor],
        sent: Mapping[str, torch.Tensor],
        version: int,
        parent_version: int,
        timeout: float | None,
        manifest: pb.WeightManifest | None = None,
    ):
        """Announce and broadcast `sent` (the tensors, or a patch version's patches and whole
        tensors, described by `manifest`); a failed broadcast pushes the tensors whole by gRPC."""
        if manifest is None:
            manifest = await asyncio.to_thread(describe, tensors, version, parent_version, self.grpc.signer)
        count_bytes(manifest)
        device = getattr(tensors, "device", None) or tensors[next(iter(tensors))].device
        backend = "nccl" if device.type == "cuda" else "gloo"
        reply = await self.grpc.stub.Announce(
            pb.AnnounceRequest(  # the epoch of the group it leads, 0 for none: the service then forms a new one
                manifest=manifest,
                transport=pb.Transport(kind=pb.COLLECTIVE, backend=backend, epoch=self.groups.epoch or 0),
            ),
            wait_for_ready=True,
            timeout=timeout,
        )
        transport = reply.transport
        try:

            def broadcast() -> int:
                return send_version(self.groups.get(transport, 0), transport, manifest, sent, self.staging)

            await asyncio.to_thread(broadcast)
        except Exception as exc:  # noqa: BLE001 - a member died or stalled: the epoch ends, gRPC carries it
            self.groups.drop()
            log.warning(
                "event=collective_failed version=%d epoch=%d error=%s fallback=grpc", version, transport.epoch, exc
            )
            with contextlib.suppress(grpc.aio.AioRpcError):
                await self.grpc.stub.Report(
                    pb.TransferReport(version=version, epoch=transport.epoch, ok=False, error=str(exc)[:500]),
                    timeout=10,
                )
            finish = getattr(tensors, "finish", None)  # a gathered view's pass the broadcast left half-way
            if finish is not None:
                await asyncio.to_thread(finish)
            return await self.grpc.push(tensors, version, parent_version, timeout)
        if backend == "nccl":  # the service (a CPU process) is no member: it keeps the version from a push
            return await self.grpc.push(tensors, version, parent_version, timeout)
        return reply

    async def close(self) -> None:
        await self.grpc.close()


class CollectiveTransport(Transport):
    name = TransportName.COLLECTIVE

    def publisher(self, grpc: GrpcWeightPublisher, options: PublishOptions) -> WeightPublisher:
        return CollectiveWeightPublisher(grpc, options.patches)

    def delivery(self, announcement: pb.VersionAnnouncement, subscriber) -> Delivery:
        return CollectiveDelivery(announcement.manifest, announcement.transport, subscriber.groups, subscriber.ring)

    def worker_buckets(self, update, manifest: pb.WeightManifest, worker) -> Iterator[Bucket]:
        spec = pb.Transport.FromString(update.spec)
        worker.groups.rendezvous = update.address  # weight-sync's, which holds the epoch's rendezvous
        try:
            yield from receive_buckets(worker.groups.get(spec, spec.rank), spec, manifest, worker.ring)
        except Exception:  # noqa: BLE001 - whatever ended the epoch, this worker leaves its group, then re-raises
            worker.groups.drop()
            raise


TRANSPORT = CollectiveTransport()
