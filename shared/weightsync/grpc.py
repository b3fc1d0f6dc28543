"""The `grpc` transport: the trainer pushes a version to the weight-sync service, a replica pulls it.

`GrpcWeightPublisher` (trainer side) pushes a state dict as a new version; `pull_version`
(replica side, called by `shared.weightsync.subscriber.GrpcWeightSubscriber`) pulls one, as a delta
against the version it holds where it can, over one or several streams, and verifies every
tensor's checksum.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence

import grpc
import torch

from shared.interfaces import WeightPublisher
from shared.rpc import DEFAULT_MAX_MESSAGE_BYTES, channel_options
from shared.rpc.auth import channel as auth_channel
from shared.rpc.steadyrl.v1 import common_pb2, weightsync_pb2_grpc
from shared.rpc.steadyrl.v1 import weightsync_pb2 as pb
from shared.weightsync.frames import Assembler, decode_delta, iter_chunks, parse_pull_frame
from shared.weightsync.manifest import (
    WeightError,
    bytes_to_tensor,
    describe,
    digest,
    tensor_to_bytes,
)

log = logging.getLogger("steadyrl.weightsync.client")



class GrpcWeightPublisher(WeightPublisher):
    def __init__(self, address: str, key: bytes | None = None, chunk_bytes: int = 1024 * 1024,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        self.channel = auth_channel(address, options=channel_options(max_message_bytes))
        self.stub = weightsync_pb2_grpc.WeightSyncStub(self.channel)
        self.key, self.chunk_bytes = key, chunk_bytes

    async def push(self, tensors: Mapping[str, torch.Tensor], version: int, parent_version: int = 0,
                   timeout: float | None = 600.0) -> pb.PushReply:
        """Push a new version; waits (up to `timeout`) for the service when it is restarting.
        Streams: the manifest is made in one pass over `tensors`, then each tensor is read again
        and sent, one at a time (a lazily cast mapping never exists whole)."""
        manifest = describe(tensors, version, parent_version, self.key)

        def requests():
            yield pb.PushRequest(manifest=manifest)
            for index, name in enumerate(tensors):
                for chunk in iter_chunks(index, tensor_to_bytes(tensors[name]), self.chunk_bytes):
                    yield pb.PushRequest(chunk=chunk)

        return await self.stub.Push(requests(), wait_for_ready=True, timeout=timeout)

    async def close(self) -> None:
        await self.channel.close()


PULL_METHOD = "/steadyrl.v1.WeightSync/Pull"


async def pull_version(
    channels: grpc.aio.Channel | Sequence[grpc.aio.Channel],
    version: int,
    base: tuple[int, pb.WeightManifest, list[bytearray]] | None = None,
) -> tuple[pb.WeightManifest, list[bytearray], int]:
    """Pull `version` (0 = latest), as a delta against `base` (version, manifest, raw bytes).

    With several channels the pull is striped: one stream per channel, in parallel (each channel
    is its own TCP connection, so gRPC's transport threads work side by side). Tensors sent in
    full are digested in worker threads as soon as their last chunk lands.
    Returns the manifest, the verified raw bytes of every tensor, and the wire bytes received.
    """
    channels = [channels] if isinstance(channels, grpc.aio.Channel) else list(channels)
    if version == 0:
        latest = await weightsync_pb2_grpc.WeightSyncStub(channels[0]).Latest(common_pb2.Empty())
        version = latest.version.version
    loop = asyncio.get_running_loop()
    state: dict = {"header": None, "assembler": None, "digests": {}, "wire": 0}

    async def stripe(index: int) -> None:
        request = pb.PullRequest(version=version, base_version=base[0] if base else 0,
                                 stripe=index, stripes=len(channels))
        call = channels[index].unary_stream(
            PULL_METHOD, request_serializer=pb.PullRequest.SerializeToString, response_deserializer=None
        )(request)
        header = None
        async for raw in call:
            frame = parse_pull_frame(raw)
            if header is None:
                if not isinstance(frame, pb.PullHeader):
                    raise WeightError("pull stream did not start with a header")
                header = frame
                if state["header"] is None:
                    state["header"] = header
                    state["assembler"] = Assembler(list(header.encoded_nbytes))
                elif header != state["header"]:
                    raise WeightError("striped pull streams disagree on the header")
                continue
            if isinstance(frame, pb.PullHeader):
                raise WeightError("a pull stream carries one header")
            tensor, offset, data = frame
            assembler = state["assembler"]
            state["wire"] += assembler.add(tensor, offset, data)
            if assembler.complete(tensor) and header.encodings[tensor] == pb.FULL:
                state["digests"][tensor] = loop.run_in_executor(None, digest, assembler.buffers[tensor])
        if header is None:
            raise WeightError("empty pull stream")

    await asyncio.gather(*(stripe(i) for i in range(len(channels))))
    header, assembler = state["header"], state["assembler"]
    manifest = header.manifest
    encoded = assembler.finish()
    base_bytes: dict[str, bytearray] = {}
    if header.base_version:
        if base is None or base[0] != header.base_version:
            raise WeightError(f"server sent a delta against {header.base_version}, which is not held")
        base_bytes = {s.name: data for s, data in zip(base[1].tensors, base[2], strict=True)}
    payloads = [
        decode_delta(enc, data, base_bytes.get(spec.name), spec.nbytes)
        for spec, enc, data in zip(manifest.tensors, header.encodings, encoded, strict=True)
    ]
    pending = {i: f for i, f in state["digests"].items()}
    for i, payload in enumerate(payloads):
        if i not in pending:
            pending[i] = loop.run_in_executor(None, digest, payload)
    sums = await asyncio.gather(*(pending[i] for i in range(len(payloads))))
    for spec, got in zip(manifest.tensors, sums, strict=True):
        if got != spec.checksum:
            raise WeightError(f"tensor {spec.name}: checksum mismatch")
    return manifest, payloads, state["wire"]


def open_channels(address: str, count: int, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[grpc.aio.Channel]:
    """`count` channels to `address`, each on its own connection (no shared subchannel pool)."""
    options = [*channel_options(max_message_bytes), ("grpc.use_local_subchannel_pool", 1)]
    return [auth_channel(address, options=options) for _ in range(count)]


def to_state_dict(manifest: pb.WeightManifest, payloads: list[bytearray]) -> dict[str, torch.Tensor]:
    return {s.name: bytes_to_tensor(d, s.dtype, list(s.shape)) for s, d in zip(manifest.tensors, payloads, strict=True)}


def _short(exc: Exception) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
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
