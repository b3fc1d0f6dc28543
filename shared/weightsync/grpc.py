"""The `grpc` transport: the trainer pushes a version to the weight-sync service, a replica pulls it.

`GrpcWeightPublisher` (trainer side) pushes a state dict as a new version (and is what every
other transport announces through); a `GrpcDelivery` (replica side, or a vLLM worker) pulls one
tensor by tensor, as a delta against the version it holds where it can, checking every tensor's
digest. `TRANSPORT`: its entry in `base.TRANSPORTS`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator, Mapping

import grpc
import torch

from shared.rpc import DEFAULT_MAX_MESSAGE_BYTES, channel_options
from shared.rpc.auth import channel as auth_channel
from shared.rpc.steadyrl.v1 import common_pb2, weightsync_pb2_grpc
from shared.rpc.steadyrl.v1 import weightsync_pb2 as pb
from shared.weightsync.base import (
    Bucket,
    Delivery,
    PartialVersion,
    PublishOptions,
    Transport,
    TransportName,
    WeightPublisher,
    as_tensor,
)
from shared.weightsync.frames import decode_delta, iter_chunks, parse_pull_frame
from shared.weightsync.manifest import (
    WeightError,
    describe,
    digest,
    tensor_to_bytes,
)
from shared.weightsync.patches import count_bytes

log = logging.getLogger("steadyrl.weightsync.client")


class GrpcWeightPublisher(WeightPublisher):
    def __init__(
        self,
        address: str,
        signer=None,
        chunk_bytes: int = 1024 * 1024,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self.address = address
        self.channel = auth_channel(address, options=channel_options(max_message_bytes))
        self.stub = weightsync_pb2_grpc.WeightSyncStub(self.channel)
        self.signer = signer
        self.chunk_bytes = chunk_bytes  # a signing.Signer: only the trainer has one

    async def push(
        self, tensors: Mapping[str, torch.Tensor], version: int, parent_version: int = 0, timeout: float | None = 600.0
    ) -> pb.PushReply:
        """Push a new version; waits (up to `timeout`) for the service when it is restarting.
        Streams: the manifest is made in one pass over `tensors`, then each tensor is read again
        and sent, one at a time (a lazily cast or gathered mapping never exists whole); both passes
        run off the event loop."""
        manifest = await asyncio.to_thread(describe, tensors, version, parent_version, self.signer)
        count_bytes(manifest)

        def chunks(index: int, name: str) -> list[pb.TensorChunk]:
            return list(iter_chunks(index, tensor_to_bytes(tensors[name]), self.chunk_bytes))

        call = self.stub.Push(wait_for_ready=True, timeout=timeout)
        try:  # the casting, gathering and copying off the event loop, a tensor at a time
            await call.write(pb.PushRequest(manifest=manifest))
            for index, name in enumerate(tensors):
                for chunk in await asyncio.to_thread(chunks, index, name):
                    await call.write(pb.PushRequest(chunk=chunk))
            await call.done_writing()
        except (asyncio.InvalidStateError, grpc.aio.AioRpcError):
            pass  # the call ended before the last chunk (a refusal, a broken stream): its status says why
        except asyncio.CancelledError:
            call.cancel()
            raise
        return await call

    async def close(self) -> None:
        await self.channel.close()


PULL_METHOD = "/steadyrl.v1.WeightSync/Pull"
# a pull's deadline when the caller gives none: a start-up allowance plus the version's bytes at a floor rate
# (a stalled service fails the pull in seconds for a small model, not in minutes); 600 s when its size is unknown
PULL_START_SECONDS = 30.0
PULL_FLOOR_BYTES_PER_SECOND = 50e6
PULL_UNSIZED_SECONDS = 600.0


def pull_deadline(manifest: pb.WeightManifest | None) -> float:
    """Seconds a pull of `manifest`'s version may take: PULL_START_SECONDS + its bytes at
    PULL_FLOOR_BYTES_PER_SECOND, or PULL_UNSIZED_SECONDS when the manifest is not known. Pure."""
    if manifest is None or not manifest.tensors:
        return PULL_UNSIZED_SECONDS
    return PULL_START_SECONDS + sum(spec.nbytes for spec in manifest.tensors) / PULL_FLOOR_BYTES_PER_SECOND


class GrpcDelivery(Delivery):
    """A version pulled from the weight-sync service over one stream, a tensor at a time (memory:
    the tensor being received): each checked against the manifest as it completes, a delta decoded
    against the receiver's own bytes of `base_version` (`base(name)`, None: a full pull).

    `open()` starts the pull and reads its header (the manifest, when it was not announced); a
    failure after the first tensor raises PartialVersion. The whole pull is bounded by `timeout`, by
    default one sized to the version (`pull_deadline`). Sync (gRPC's sync API), so it runs where
    the bytes are applied: an engine's thread, or a vLLM worker."""

    transport = TransportName.GRPC

    def __init__(
        self,
        address: str,
        version: int,
        manifest: pb.WeightManifest | None = None,
        base_version: int = 0,
        base=None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        timeout: float | None = None,
        verifier=None,
    ) -> None:
        super().__init__(manifest or pb.WeightManifest(version=version))
        self.verifier = verifier  # a signing.Verifier the pulled manifest must pass (None: not checked)
        self.address = address
        self.base_version = base_version if base is not None else 0
        self.base = base
        self.max_message_bytes = max_message_bytes
        self.timeout = timeout if timeout is not None else pull_deadline(manifest)
        self.wire_bytes = 0
        self._channel = self._frames = self._header = None

    def open(self) -> pb.WeightManifest:
        if self._header is not None:
            return self.manifest
        from shared.rpc.auth import token_from_env
        from shared.rpc.tls import sync_channel, tls_from_env

        self._channel = sync_channel(self.address, options=channel_options(self.max_message_bytes), tls=tls_from_env())
        token = token_from_env()
        call = self._channel.unary_stream(
            PULL_METHOD, request_serializer=pb.PullRequest.SerializeToString, response_deserializer=None
        )
        self._frames = iter(
            call(
                pb.PullRequest(version=self.version, base_version=self.base_version),
                metadata=[("authorization", f"Bearer {token}")] if token else None,
                timeout=self.timeout,
            )
        )
        try:
            header = parse_pull_frame(next(self._frames))
        except (StopIteration, grpc.RpcError) as exc:
            self.close()
            raise WeightError(f"pull of version {self.version}: {_short(exc)}") from exc
        try:
            if not isinstance(header, pb.PullHeader):
                raise WeightError("pull stream did not start with a header")
            if self.manifest.tensors and header.manifest != self.manifest:
                raise WeightError(f"version {self.version}: the pulled manifest is not the announced one")
            if self.version and header.manifest.version != self.version:
                raise WeightError(f"asked for version {self.version}, the pull holds {header.manifest.version}")
            if self.verifier is not None:
                self.verifier.check(header.manifest)
        except WeightError:
            self.close()
            raise
        self.manifest = header.manifest
        self._header = header
        return self.manifest

    def tensors(self):
        """(spec, raw bytes) of each tensor in manifest order, checked; PartialVersion after the first."""
        header = self._header or (self.open() and self._header)
        specs = list(self.manifest.tensors)
        done = 0
        try:
            for index, spec in enumerate(specs):
                encoded = bytearray(header.encoded_nbytes[index])
                received = 0
                while received < len(encoded):
                    frame = parse_pull_frame(next(self._frames))
                    if isinstance(frame, pb.PullHeader) or frame[0] != index or frame[1] != received:
                        raise WeightError(f"tensor {spec.name}: a chunk out of order")
                    encoded[received : received + len(frame[2])] = frame[2]
                    received += len(frame[2])
                self.wire_bytes += received
                base = self.base(spec.name) if header.encodings[index] != pb.FULL else None
                data = decode_delta(header.encodings[index], encoded, base, spec.nbytes)
                if digest(data) != spec.checksum:
                    raise WeightError(f"tensor {spec.name}: checksum mismatch")
                yield spec, data
                done += 1
        except (StopIteration, grpc.RpcError, WeightError) as exc:
            reason = exc if isinstance(exc, WeightError) else WeightError(f"pull cut short: {_short(exc)}")
            raise (PartialVersion if done else WeightError)(str(reason)) from exc
        finally:
            self.close()

    def prepare(self) -> None:
        """Start the pull and read its manifest (before the engine pauses)."""
        self.open()

    def buckets(self) -> Iterator[Bucket]:
        """One tensor per bucket: the memory a pull holds is the tensor it is on."""
        for spec, data in self.tensors():
            yield [(spec.name, as_tensor(data, spec))]

    def worker_update(self) -> dict:
        return {
            "transport": str(self.transport),
            "address": self.address,
            "version": self.version,
            "manifest": self.manifest.SerializeToString(),
        }

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None


class GrpcTransport(Transport):
    name = TransportName.GRPC

    def publisher(self, grpc: GrpcWeightPublisher, options: PublishOptions) -> WeightPublisher:
        return grpc

    def delivery(self, announcement: pb.VersionAnnouncement, subscriber) -> Delivery:
        return subscriber.pull(
            announcement.version.version, announcement.manifest if announcement.manifest.tensors else None
        )

    def worker_buckets(self, update, manifest: pb.WeightManifest, worker) -> Iterator[Bucket]:
        return GrpcDelivery(
            update.address, update.version or manifest.version, manifest if manifest.tensors else None
        ).buckets()


TRANSPORT = GrpcTransport()


def _short(exc: BaseException) -> str:
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        return exc.code().name
    return type(exc).__name__


async def latest_version(address: str) -> int:
    async with auth_channel(address) as channel:
        try:
            info = await weightsync_pb2_grpc.WeightSyncStub(channel).Latest(common_pb2.Empty())
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return 0
            raise
        return info.version.version
