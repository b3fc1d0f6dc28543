"""A replica's side of the weights (`shared.weightsync.base.WeightSubscriber`): watch the weight-sync service, turn
each announced version into the `Delivery` of its transport (`deliveries`), and hand it to the engine to apply.

Whatever carried it, a version's manifest must carry the run's trainer's signature (`signing.Verifier`) and every
tensor is checked against it before it is used, or the version is not served. A failed version never leaves a mixed
one served: the replica keeps its version, or restores a whole one.

Details: docs/internals/weights.md"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections import deque
from collections.abc import Awaitable, Callable, Sequence

import grpc
from prometheus_client import Counter

from shared.rpc import DEFAULT_MAX_MESSAGE_BYTES
from shared.rpc.auth import channel as auth_channel
from shared.rpc.steadyrl.v1 import weightsync_pb2 as pb
from shared.rpc.steadyrl.v1 import weightsync_pb2_grpc
from shared.weightsync.base import Delivery, PartialVersion, WeightError, WeightSubscriber, transport_of_kind
from shared.weightsync.collective import Groups, Staging
from shared.weightsync.grpc import GrpcDelivery, _short, latest_version

log = logging.getLogger("steadyrl.weightsync.client")
RECEIVED = Counter(
    "steadyrl_inference_weight_versions_received_total",
    "Weight versions a replica received and verified, by how they came",
    ["transport"],
)
REFUSED = Counter(
    "steadyrl_inference_weight_versions_refused_total",
    "Weight versions refused (bad bytes, a failed transfer)",
    ["transport"],
)
RESTORED = Counter("steadyrl_inference_weight_restores_total", "Whole versions applied after one failed half-way")
Apply = Callable[[Delivery], Awaitable[float]]
Base = Callable[[str, str], memoryview | None]  # (name, dtype) → the served version's bytes, or None


def check_announcement(announcement: pb.VersionAnnouncement, served: int, verifier=None) -> None:
    """WeightError unless the announced version may be taken: newer than `served`; with its
    manifest on the announcement (every transport but gRPC, and gRPC when it sends one: its sizes
    bound the pull), one that lists tensors, holds the announced number and passes `verifier` (the
    trainer's signature, this run and its instance)."""
    announced = announcement.version.version
    if announced <= served:
        raise WeightError(f"version {announced} is not newer than the served {served}")
    manifest = announcement.manifest
    if announcement.transport.kind == pb.GRPC and not manifest.tensors:
        return  # the manifest comes with the pull, checked there (its deadline: an unsized pull's)
    if not manifest.tensors:
        raise WeightError(f"version {announced} was announced without the manifest of its bytes")
    if manifest.version != announced:
        raise WeightError(f"version {announced} was announced with the manifest of version {manifest.version}")
    if verifier is not None:
        verifier.check(manifest)


class WholeAfterBroadcast(Delivery):
    """A patch version broadcast to a member that does not hold its base: the broadcast received
    and let go of (the group stays in step), then the version pulled whole from weight-sync. A vLLM
    worker, which joins the group itself, refuses it after receiving it (the epoch then ends)."""

    transport = GrpcDelivery.transport

    def __init__(self, broadcast: Delivery, pull: GrpcDelivery) -> None:
        super().__init__(broadcast.manifest)
        self.broadcast = broadcast
        self.pull = pull
        self.drained = False

    @property
    def wire_bytes(self) -> int:
        return self.pull.wire_bytes

    def prepare(self) -> None:
        if not self.drained:
            for _ in self.broadcast.buckets():
                pass
            self.drained = True
        self.pull.prepare()

    def buckets(self):
        self.prepare()
        yield from self.pull.buckets()

    def worker_update(self) -> dict:
        return self.broadcast.worker_update()

    def close(self) -> None:
        self.broadcast.close()
        self.pull.close()


class WatchSubscriber(WeightSubscriber):
    """Watch weight-sync → each version's delivery by its transport (`base.transport_of_kind`) →
    `apply(delivery)` (the engine's, off the event loop), resuming after dropped streams."""

    def __init__(
        self,
        address: str,
        apply: Apply,
        subscriber_id: str = "",
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        backoff: tuple[float, float] = (0.2, 5.0),
        transports: Sequence[str] = ("grpc",),
        host: str | None = None,
        base: Base | None = None,
        version: int = 0,
        verifier=None,
        patchable: Callable[[pb.WeightManifest], bool] | None = None,
    ) -> None:
        self.address = address
        self.patchable = patchable  # the engine's own word on a patch version (else: `base` holds its bytes)
        self.apply = apply
        self.subscriber_id = subscriber_id
        self.verifier = verifier  # a signing.Verifier (None: versions taken unsigned)
        self.max_message_bytes = max_message_bytes
        self.backoff = backoff
        self.base = base
        self.transports = [pb.WeightTransportKind.Value(t.upper()) for t in transports]
        self.host = host or socket.gethostname()
        self._version = version  # the version the engine serves
        self.manifest: pb.WeightManifest | None = None  # its manifest, once one came
        self.applied: list[int] = []
        self.received: dict[str, int] = {}  # versions received, by transport
        # versions refused (bad bytes, not the trainer's), never asked for again: a set, not the
        # highest, so that a refused number far ahead stops nothing of the trainer's own
        self.refused: deque[int] = deque(maxlen=64)
        self.wire_bytes = 0
        self.whole = 0  # patch versions taken whole instead (another version served, or bytes not held as published)
        self.reconnects = 0
        self.groups = Groups(address)
        self.ring = Staging()  # an in-process collective member's group and ring

    @property
    def version(self) -> int:
        return self._version

    def deliveries(self, announcement: pb.VersionAnnouncement) -> Delivery:
        """The delivery of an announced version, by the transport it takes. Every one is checked
        before anything of it is used (WeightError otherwise): its number newer than the one served;
        a manifest riding on the announcement (shm, collective) lists tensors, carries that same
        number and is the run's trainer's; a gRPC pull's manifest is checked as it arrives
        (`GrpcDelivery.open`: the number asked for, the trainer's signature)."""
        check_announcement(announcement, self.version, self.verifier)
        manifest = announcement.manifest
        delivery = transport_of_kind(announcement.transport.kind).delivery(announcement, self)
        if manifest.patch_base and announcement.transport.kind != pb.GRPC and not self.takes_patch(manifest):
            self.whole += 1
            log.info(
                "event=weights_whole version=%d patch_base=%d served=%d",
                manifest.version,
                manifest.patch_base,
                self.version,
            )
            # whole (or a delta against what it holds), never the patch; a broadcast is received first, in step
            pull = self.pull(manifest.version, manifest)
            return WholeAfterBroadcast(delivery, pull) if announcement.transport.kind == pb.COLLECTIVE else pull
        return delivery

    def takes_patch(self, manifest: pb.WeightManifest) -> bool:
        """Whether the engine holds exactly the bytes a patch version's patches apply to: it serves
        their base version, whole, and holds every patched tensor as published (`base`)."""
        if self.version != manifest.patch_base or self.manifest is None:
            return False
        if self.patchable is not None:
            return self.patchable(manifest)
        if self.base is None:
            return False
        return all(self.base(spec.name, spec.dtype) is not None for spec in manifest.tensors if spec.HasField("patch"))

    def pull(self, version: int, manifest: pb.WeightManifest | None = None, delta: bool = True) -> GrpcDelivery:
        """A gRPC pull of `version`: a delta against the served version when the engine holds its
        exact bytes, else whole."""
        base = None
        if delta and self.base is not None and self.manifest is not None:
            dtypes = {spec.name: spec.dtype for spec in self.manifest.tensors}
            if all(self.base(name, dtype) is not None for name, dtype in dtypes.items()):
                base = lambda name: self.base(name, dtypes[name])  # noqa: E731
        return GrpcDelivery(
            self.address,
            version,
            manifest,
            self.version if base else 0,
            base,
            self.max_message_bytes,
            verifier=self.verifier,
        )

    async def run(self, stop: asyncio.Event | None = None) -> None:
        delay = self.backoff[0]
        while stop is None or not stop.is_set():
            channel = auth_channel(self.address, options=[("grpc.max_receive_message_length", self.max_message_bytes)])
            watch = None
            try:
                stub = weightsync_pb2_grpc.WeightSyncStub(channel)
                watch = stub.Watch(
                    pb.WatchRequest(
                        after_version=self.version,
                        subscriber_id=self.subscriber_id,
                        transports=self.transports,
                        host=self.host,
                    )
                )
                async for announcement in watch:
                    rejoin = await self._receive(stub, announcement)
                    delay = self.backoff[0]
                    if rejoin:
                        break  # subscribe again: the next collective epoch includes us
            except (grpc.aio.AioRpcError, WeightError) as exc:
                self.reconnects += 1
                log.warning(
                    "event=weights_stream_lost error=%s retry_in=%.1fs held=%d", _short(exc), delay, self.version
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.backoff[1])
            finally:
                if watch is not None:
                    watch.cancel()
                await channel.close()

    async def _receive(self, stub, announcement: pb.VersionAnnouncement) -> bool:
        """Apply one announced version; True when this subscriber should subscribe again."""
        version = announcement.version.version
        kind = announcement.transport.kind
        if version <= self.version or version in self.refused:
            return False
        try:
            delivery = self.deliveries(announcement)
        except WeightError as exc:  # not the trainer's: never applied, never asked for again
            REFUSED.labels(pb.WeightTransportKind.Name(kind).lower()).inc()
            log.warning("event=weights_refused version=%d reason=signature error=%s", version, exc)
            self.refused.append(version)
            await self._report(stub, announcement, str(exc))
            return kind == pb.COLLECTIVE
        try:
            await self._use(delivery)
        except PartialVersion as exc:
            REFUSED.labels(delivery.transport).inc()
            log.warning(
                "event=weights_refused version=%d transport=%s partial=true error=%s", version, delivery.transport, exc
            )
            await self._report(stub, announcement, str(exc))
            patience = announcement.transport.timeout_seconds * 2 or 120
            await self._restore(version, patience)
            if self.version < version:  # then the failed version itself, by gRPC, once the service holds it
                with contextlib.suppress(WeightError):
                    await self._pull_when_held(version, patience)
            return kind == pb.COLLECTIVE
        except (WeightError, OSError, grpc.RpcError, RuntimeError) as exc:
            # RuntimeError: a collective's group broke (gloo: "Connection closed by peer", its publisher
            # restarted); like any failed transfer it is reported and the version pulled by gRPC
            REFUSED.labels(delivery.transport).inc()
            log.warning(
                "event=weights_refused version=%d transport=%s error=%s",
                version,
                delivery.transport,
                _short(exc) if isinstance(exc, grpc.RpcError) else exc,
            )
            if kind == pb.GRPC:
                self.refused.append(version)
                return False
            await self._report(stub, announcement, str(exc))
            await self._pull_when_held(version, announcement.transport.timeout_seconds * 2 or 120)
            return kind == pb.COLLECTIVE
        await self._report(stub, announcement, "")
        return False

    async def _use(self, delivery: Delivery) -> None:
        try:
            await self.apply(delivery)
        finally:
            delivery.close()
        self._version = delivery.version
        self.manifest = delivery.manifest
        self.applied.append(delivery.version)
        self.wire_bytes += getattr(delivery, "wire_bytes", 0)
        self.received[delivery.transport] = self.received.get(delivery.transport, 0) + 1
        RECEIVED.labels(delivery.transport).inc()

    async def _report(self, stub, announcement: pb.VersionAnnouncement, error: str) -> None:
        """How a collective went, for the service (a failure ends the epoch)."""
        if announcement.transport.kind != pb.COLLECTIVE:
            return
        if error:
            self.groups.drop()
        with contextlib.suppress(grpc.aio.AioRpcError):
            await stub.Report(
                pb.TransferReport(
                    version=announcement.version.version,
                    epoch=announcement.transport.epoch,
                    ok=not error,
                    subscriber_id=self.subscriber_id,
                    error=error[:500],
                ),
                timeout=10,
            )

    async def _pull_when_held(self, version: int, patience: float) -> bool:
        """Pull `version` once the service holds it (after a failed collective the trainer pushes it),
        or the newest version once the service holds a newer one: a restarted service never holds
        what was published before it, and the trainer has moved on."""
        deadline = asyncio.get_running_loop().time() + patience
        while asyncio.get_running_loop().time() < deadline:
            try:
                await self._use(self.pull(version))
                return True
            except PartialVersion:
                raise
            except WeightError as exc:
                if "NOT_FOUND" not in str(exc):
                    raise
            try:
                newest = await latest_version(self.address)
            except grpc.aio.AioRpcError as exc:
                raise WeightError(f"the newest version could not be asked for: {_short(exc)}") from exc
            if newest > version:
                log.warning("event=weights_superseded version=%d newest=%d", version, newest)
                version = newest
                continue
            await asyncio.sleep(0.5)
        log.warning("event=weights_skipped version=%d reason=never_held", version)
        return False

    async def _restore(self, failed: int, patience: float) -> None:
        """A whole version into an engine that holds neither: the one served before the failure
        (pulled whole: the engine's bytes are mixed), else `failed` once the service holds it."""
        served = self.version
        self.manifest = None  # no delta against bytes the engine no longer holds
        for version in ([served] if served else []) + [failed]:
            try:
                if await self._pull_when_held(version, patience if version == failed else 1.0):
                    RESTORED.inc()
                    log.warning("event=weights_restored version=%d after=%d", self.version, failed)
                    return
            except WeightError as exc:  # PartialVersion included
                log.warning("event=weights_restore_failed version=%d error=%s", version, exc)
        raise WeightError(f"no whole version could be applied after version {failed} failed half-way")
