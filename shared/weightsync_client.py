"""Client helpers of the weight-sync service.

`GrpcWeightPublisher` (trainer side) pushes a state dict as a new version. `GrpcWeightSubscriber`
(replica side) watches for versions, pulls each one (as a delta against the version it holds),
verifies every tensor's checksum and hands a complete state dict to a callback; when a stream
drops it reconnects with backoff and resumes from the version it holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence

import grpc
import torch
from prometheus_client import Counter

from shared.interfaces import WeightPublisher, WeightSubscriber
from shared.rpc import DEFAULT_MAX_MESSAGE_BYTES, channel_options
from shared.rpc.auth import channel as auth_channel
from shared.rpc.steadyrl.v1 import common_pb2, weightsync_pb2_grpc
from shared.rpc.steadyrl.v1 import weightsync_pb2 as pb
from shared.weights import (
    Assembler,
    WeightError,
    bytes_to_tensor,
    decode_delta,
    describe,
    digest,
    iter_chunks,
    parse_pull_frame,
    tensor_to_bytes,
)

log = logging.getLogger("steadyrl.weightsync.client")
RECEIVED = Counter("steadyrl_inference_weight_versions_received_total", "Weight versions a replica received and "
                   "verified, by how they came", ["transport"])
REFUSED = Counter("steadyrl_inference_weight_versions_refused_total", "Weight versions refused (bad bytes, a failed "
                  "transfer)", ["transport"])
OnVersion = Callable[[int, dict[str, torch.Tensor]], Awaitable[None] | None]


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


class GrpcWeightSubscriber(WeightSubscriber):
    """Watch → receive → verify → `on_version(version, state_dict)`, resuming after dropped
    streams. The service says how each version comes: a gRPC pull (as a delta against the
    version held), a shared-memory file to map, or a collective broadcast to join; a version
    that fails to arrive on shm or a collective is pulled over gRPC instead, and after a failed
    collective the subscriber subscribes again, to join the next epoch."""

    def __init__(self, address: str, on_version: OnVersion, subscriber_id: str = "",
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, backoff: tuple[float, float] = (0.2, 5.0),
                 streams: int = 1, transports: Sequence[str] = ("grpc",), host: str | None = None) -> None:
        import socket

        from shared.weight_transport import Groups

        self.address, self.on_version, self.subscriber_id = address, on_version, subscriber_id
        self.max_message_bytes, self.backoff, self.streams = max_message_bytes, backoff, streams
        self.transports = [pb.WeightTransportKind.Value(t.upper()) for t in transports]
        self.host = host or socket.gethostname()
        self.held: tuple[int, pb.WeightManifest, list[bytearray]] | None = None
        self.applied: list[int] = []
        self.received: dict[str, int] = {}  # versions received, by transport
        self.refused = 0  # the newest version refused as corrupt (never asked for again)
        self.wire_bytes = 0
        self.reconnects = 0
        self.groups = Groups()

    @property
    def version(self) -> int:
        return self.held[0] if self.held else 0

    async def run(self, stop: asyncio.Event | None = None) -> None:
        delay = self.backoff[0]
        while stop is None or not stop.is_set():
            channels = open_channels(self.address, self.streams, self.max_message_bytes)
            watch = None
            try:
                stub = weightsync_pb2_grpc.WeightSyncStub(channels[0])
                watch = stub.Watch(pb.WatchRequest(after_version=self.version, subscriber_id=self.subscriber_id,
                                                   transports=self.transports, host=self.host))
                async for announcement in watch:
                    rejoin = await self._receive(channels, stub, announcement)
                    delay = self.backoff[0]
                    if rejoin:
                        break  # subscribe again: the next collective epoch includes us
            except (grpc.aio.AioRpcError, WeightError) as exc:
                self.reconnects += 1
                log.warning("event=weights_stream_lost error=%s retry_in=%.1fs held=%d", _short(exc), delay, self.version)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.backoff[1])
            finally:
                if watch is not None:
                    watch.cancel()
                await asyncio.gather(*(c.close() for c in channels))

    async def _receive(self, channels, stub, announcement: pb.VersionAnnouncement) -> bool:
        """Receive one announced version; True when this subscriber should subscribe again."""
        from shared.weight_transport import read_shm, receive_version

        version, transport = announcement.version.version, announcement.transport
        if version <= max(self.version, self.refused):
            return False
        if transport.kind == pb.SHM:
            try:
                tensors = await asyncio.to_thread(read_shm, transport.shm_path, announcement.manifest)
                return await self._use(announcement.manifest, tensors, "shm")
            except (OSError, WeightError) as exc:
                REFUSED.labels("shm").inc()
                log.warning("event=weights_refused version=%d transport=shm error=%s", version, exc)
        elif transport.kind == pb.COLLECTIVE:
            try:
                def join():
                    group = self.groups.get(transport, transport.rank)
                    return receive_version(group, transport, announcement.manifest)

                tensors = await asyncio.to_thread(join)
                await stub.Report(pb.TransferReport(version=version, epoch=transport.epoch, ok=True,
                                                    subscriber_id=self.subscriber_id), timeout=10)
                return await self._use(announcement.manifest, tensors, "collective")
            except Exception as exc:  # noqa: BLE001 - a dead peer, a timeout, corrupted bytes: pull it instead
                self.groups.drop()
                REFUSED.labels("collective").inc()
                log.warning("event=weights_refused version=%d transport=collective epoch=%d error=%s", version,
                            transport.epoch, exc)
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await stub.Report(pb.TransferReport(version=version, epoch=transport.epoch, ok=False,
                                                        subscriber_id=self.subscriber_id, error=str(exc)[:500]),
                                      timeout=10)
                await self._pull_when_held(channels, version, transport.timeout_seconds * 2 or 120)
                return True
        try:
            await self._apply(channels, version)
        except (WeightError, grpc.aio.AioRpcError) as exc:
            if isinstance(exc, grpc.aio.AioRpcError) and exc.code() != grpc.StatusCode.DATA_LOSS:
                raise
            REFUSED.labels("grpc").inc()
            self.refused = version
            log.warning("event=weights_refused version=%d transport=grpc error=%s", version, _short(exc))
        return False

    async def _use(self, manifest: pb.WeightManifest, tensors: dict[str, torch.Tensor], how: str) -> bool:
        payloads = [tensor_to_bytes(tensors[spec.name]) for spec in manifest.tensors]
        await self._deliver(manifest, tensors, payloads)
        self.received[how] = self.received.get(how, 0) + 1
        RECEIVED.labels(how).inc()
        return False

    async def _pull_when_held(self, channels, version: int, patience: float) -> None:
        """Pull `version` once the service holds it (after a failed collective the trainer pushes it)."""
        deadline = asyncio.get_running_loop().time() + patience
        while asyncio.get_running_loop().time() < deadline:
            try:
                await self._apply(channels, version)
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:
                    raise
                await asyncio.sleep(0.5)
        log.warning("event=weights_skipped version=%d reason=never_held", version)

    async def _apply(self, channels: list[grpc.aio.Channel], announced: int) -> None:
        if announced <= self.version:
            return
        manifest, payloads, wire = await pull_version(channels, announced, self.held)
        self.wire_bytes += wire
        await self._deliver(manifest, to_state_dict(manifest, payloads), payloads)
        self.received["grpc"] = self.received.get("grpc", 0) + 1
        RECEIVED.labels("grpc").inc()

    async def _deliver(self, manifest: pb.WeightManifest, state_dict: dict[str, torch.Tensor], payloads) -> None:
        result = self.on_version(manifest.version, state_dict)
        if asyncio.iscoroutine(result):
            await result
        self.held = (manifest.version, manifest, payloads)
        self.applied.append(manifest.version)


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
