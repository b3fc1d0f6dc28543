"""A replica's side of the weights (`shared.interfaces.WeightSubscriber`): whatever transport
each version takes, it arrives verified against the signed manifest or not at all."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence

import grpc
import torch
from prometheus_client import Counter

from shared.interfaces import WeightSubscriber
from shared.rpc import DEFAULT_MAX_MESSAGE_BYTES
from shared.rpc.steadyrl.v1 import weightsync_pb2 as pb
from shared.rpc.steadyrl.v1 import weightsync_pb2_grpc
from shared.weightsync.collective import Groups, Staging, receive_version
from shared.weightsync.grpc import _short, open_channels, pull_version, to_state_dict
from shared.weightsync.manifest import WeightError, tensor_to_bytes
from shared.weightsync.shm import read_shm

log = logging.getLogger("steadyrl.weightsync.client")
RECEIVED = Counter("steadyrl_inference_weight_versions_received_total", "Weight versions a replica received and "
                   "verified, by how they came", ["transport"])
REFUSED = Counter("steadyrl_inference_weight_versions_refused_total", "Weight versions refused (bad bytes, a failed "
                  "transfer)", ["transport"])
OnVersion = Callable[[int, dict[str, torch.Tensor]], Awaitable[None] | None]


class GrpcWeightSubscriber(WeightSubscriber):
    """Watch → receive → verify → `on_version(version, state_dict)`, resuming after dropped
    streams. The service says how each version comes: a gRPC pull (as a delta against the
    version held), a shared-memory file to map, or a collective broadcast to join; a version
    that fails to arrive on shm or a collective is pulled over gRPC instead, and after a failed
    collective the subscriber subscribes again, to join the next epoch."""

    def __init__(self, address: str, on_version: OnVersion, subscriber_id: str = "",
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, backoff: tuple[float, float] = (0.2, 5.0),
                 streams: int = 1, transports: Sequence[str] = ("grpc",), host: str | None = None,
                 in_use: Callable[[int], bool] | None = None) -> None:
        import socket

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
        # collective versions land in one of two resident buffer sets, reused only when neither
        # this subscriber (`held`, its delta base) nor the consumer (`in_use`) still reads them;
        # without `in_use` every version gets fresh buffers (the consumer may keep what it got)
        self.in_use = in_use
        self.staging: list[tuple[int, Staging]] = []

    def _staging_for(self, version: int) -> Staging:
        if self.in_use is None:
            return Staging()
        free = [(v, s) for v, s in self.staging if v != self.version and not self.in_use(v)]
        if not free and len(self.staging) >= 2:
            return Staging()  # both sets still in use: this version gets its own buffers
        staging = free[0][1] if free else Staging()
        self.staging = [(v, s) for v, s in self.staging if s is not staging] + [(version, staging)]
        return staging

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
                staging = self._staging_for(version)

                def join():
                    group = self.groups.get(transport, transport.rank)
                    return receive_version(group, transport, announcement.manifest, staging=staging)

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
