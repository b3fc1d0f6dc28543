"""The weight-sync service: the control plane of weights. Every version is announced with its manifest, which only
the run's trainer can sign (`shared.weightsync.signing`; others are refused, PERMISSION_DENIED). Its bytes come by gRPC
Push, a shared-memory file or a collective broadcast (this service is rank 1), and it keeps versions for gRPC pulls.
A repeated push of the same weights is a success; any other version not newer than the latest is refused
(FAILED_PRECONDITION). Watch subscribers are told how they receive each version (`members.py`).

Details: docs/internals/weights.md"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine

import grpc
from prometheus_client import Counter, Gauge, Histogram

from services.weightsync.config import WeightSyncSettings
from services.weightsync.members import GRPC, Membership, Subscriber, SubscriberTaken
from services.weightsync.rendezvous import RendezvousError, RendezvousRequestError, parse_amount
from services.weightsync.store import VersionStore
from services.weightsync.transfers import BaseNotHeld, Transfers
from shared.rpc.steadyrl.v1 import common_pb2, weightsync_pb2_grpc
from shared.rpc.steadyrl.v1 import weightsync_pb2 as pb
from shared.runstore.run_instance import resolve_instance
from shared.runtime.service_lifecycle import Api, Listen, ServiceLifecycle, serve_service
from shared.weightsync.base import WeightError, kind
from shared.weightsync.frames import Assembler, encode_chunk_frame, encode_delta
from shared.weightsync.manifest import same_weights, validate_manifest, verify_payloads
from shared.weightsync.signing import verifier_of

log = logging.getLogger("steadyrl.weightsync")

VERSIONS_HELD = Gauge("steadyrl_weightsync_versions_held", "Versions retained (memory + disk)")
LATEST_VERSION = Gauge("steadyrl_weightsync_latest_version", "Newest complete version")
BYTES_PUSHED = Counter("steadyrl_weightsync_pushed_bytes_total", "Bytes received by Push")
BYTES_PULLED = Counter("steadyrl_weightsync_pulled_bytes_total", "Bytes sent by Pull (wire bytes)")
PUSH_SECONDS = Histogram("steadyrl_weightsync_push_seconds", "Duration of successful pushes")
PULL_SECONDS = Histogram("steadyrl_weightsync_pull_seconds", "Duration of completed pulls", ["mode"])
SUBSCRIBERS = Gauge("steadyrl_weightsync_subscribers", "Open Watch streams")
ANNOUNCED = Counter("steadyrl_weightsync_versions_announced_total", "Versions announced", ["transport"])
FAILURES = Counter("steadyrl_weightsync_failures_total", "Failed pushes and pulls", ["op", "reason"])


class WeightSyncServicer(weightsync_pb2_grpc.WeightSyncServicer):
    def __init__(self, settings: WeightSyncSettings) -> None:
        self.settings = settings
        self.verifier = verifier_of(settings, settings.run_id)  # None: unsigned_weights
        self.store = VersionStore(settings.retain_versions, settings.memory_versions, settings.spill_dir)
        self.members = Membership()
        self.transfers = Transfers(settings, self.store, self.members, self._stored)

    async def _fail(self, context, op: str, reason: str, code: grpc.StatusCode, message: str, rest=None):
        FAILURES.labels(op, reason).inc()
        log.warning("event=%s_failed reason=%s detail=%s", op, reason, message)
        if rest is not None:  # a refused push is read to its end (bounded), so that its sender gets this
            await self._drain(rest)  # status and not a write broken by the early answer
        await context.abort(code, message)

    async def _drain(self, request_iterator) -> None:
        left = self.settings.max_version_bytes + self.settings.max_message_bytes
        with contextlib.suppress(Exception):
            async for item in request_iterator:
                left -= item.ByteSize()
                if left < 0:
                    return

    async def Push(self, request_iterator, context):
        started = time.perf_counter()
        manifest = None
        assembler = None
        received = 0
        try:
            async for item in request_iterator:
                if manifest is None:
                    if not item.HasField("manifest"):
                        raise WeightError("the first message of a push must be the manifest")
                    manifest = item.manifest
                    validate_manifest(manifest, self.settings.max_version_bytes)
                    try:
                        self._verify(manifest)
                    except WeightError as exc:
                        await self._fail(
                            context, "push", "signature", grpc.StatusCode.PERMISSION_DENIED, str(exc), request_iterator
                        )
                    pending = self.store.versions.get(manifest.version)
                    if pending is not None and pending.ready is not None:  # a failed broadcast's patch, pushed whole
                        self.store.discard(manifest.version)
                    latest = self.store.latest
                    if latest is not None and manifest.version <= latest.manifest.version:
                        held = self.store.versions.get(manifest.version)
                        if held is not None and same_weights(held.manifest, manifest):
                            await self._drain(request_iterator)  # the same version again: it is here
                            log.info("event=push_repeated version=%d", manifest.version)
                            return pb.PushReply(version=held.info().version)
                        await self._fail(
                            context,
                            "push",
                            "stale_version",
                            grpc.StatusCode.FAILED_PRECONDITION,
                            f"version {manifest.version} is not newer than {latest.manifest.version}",
                            request_iterator,
                        )
                    await asyncio.to_thread(self.store.make_room)  # spill before the new bytes arrive
                    assembler = Assembler([t.nbytes for t in manifest.tensors])
                elif item.HasField("chunk"):
                    chunk = item.chunk
                    received += assembler.add(chunk.tensor_index, chunk.offset, chunk.data)
                else:
                    raise WeightError("a push may carry one manifest, then chunks")
            if manifest is None:
                raise WeightError("empty push stream")
            payloads = assembler.finish()
            verify_payloads(manifest, payloads)
        except WeightError as exc:
            await self._fail(context, "push", "invalid", grpc.StatusCode.INVALID_ARGUMENT, str(exc), request_iterator)
        except asyncio.CancelledError:
            FAILURES.labels("push", "cancelled").inc()
            log.warning(
                "event=push_failed reason=cancelled version=%s bytes=%d", manifest and manifest.version, received
            )
            raise
        BYTES_PUSHED.inc(received)
        self.store.add(manifest, payloads)
        self._stored(manifest, skip=frozenset())
        PUSH_SECONDS.observe(time.perf_counter() - started)
        log.info(
            "event=version_published version=%d kind=%s transport=grpc bytes=%d tensors=%d",
            manifest.version,
            kind(manifest),
            received,
            len(manifest.tensors),
        )
        return pb.PushReply(version=self.store.versions[manifest.version].info().version, bytes_received=received)

    def _verify(self, manifest: pb.WeightManifest) -> None:
        if self.verifier is not None:
            self.verifier.check(manifest)

    def _latest_version(self) -> int:
        latest = self.store.latest
        return latest.manifest.version if latest else 0

    def _stored(self, manifest: pb.WeightManifest, skip: frozenset[str]) -> None:
        """A version is held: tell every subscriber not served otherwise (`skip`) to pull it."""
        VERSIONS_HELD.set(len(self.store.versions))
        LATEST_VERSION.set(manifest.version)
        info = self.store.versions[manifest.version].info()
        for subscriber in self.members.subscribers.values():
            if subscriber.id not in skip:
                subscriber.queue.put_nowait(
                    pb.VersionAnnouncement(
                        version=info.version, total_bytes=info.total_bytes, transport=pb.Transport(kind=GRPC)
                    )
                )

    async def Watch(self, request, context):
        try:
            subscriber = await self.members.join(
                Subscriber(
                    request.subscriber_id or f"anonymous-{id(context)}", {GRPC, *request.transports}, request.host
                )
            )
        except SubscriberTaken as exc:
            await self._fail(context, "watch", "subscriber_taken", grpc.StatusCode.ALREADY_EXISTS, str(exc))
        SUBSCRIBERS.set(len(self.members.subscribers))
        latest = self.store.latest
        if latest is not None and latest.manifest.version > request.after_version:
            info = latest.info()
            subscriber.queue.put_nowait(
                pb.VersionAnnouncement(
                    version=info.version, total_bytes=info.total_bytes, transport=pb.Transport(kind=GRPC)
                )
            )
        seen = request.after_version
        try:
            while True:
                announcement = await subscriber.queue.get()
                if announcement.version.version > seen:
                    seen = announcement.version.version
                    yield announcement
        finally:
            self.members.remove(subscriber)
            SUBSCRIBERS.set(len(self.members.subscribers))

    async def Announce(self, request, context):
        """A version whose bytes travel by shared memory or by a collective (see the module)."""
        manifest = request.manifest
        kind = request.transport.kind
        try:
            validate_manifest(manifest, self.settings.max_version_bytes)
        except WeightError as exc:
            await self._fail(context, "announce", "invalid", grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            self._verify(manifest)
        except WeightError as exc:
            await self._fail(context, "announce", "signature", grpc.StatusCode.PERMISSION_DENIED, str(exc))
        await self.transfers.settled()  # the previous collective, bounded by its timeout
        if manifest.version <= self._latest_version():
            await self._fail(
                context,
                "announce",
                "stale_version",
                grpc.StatusCode.FAILED_PRECONDITION,
                f"version {manifest.version} is not newer than {self._latest_version()}",
            )
        ANNOUNCED.labels(pb.WeightTransportKind.Name(kind).lower()).inc()
        try:
            return await self.transfers.announce(manifest, request.transport)
        except ValueError as exc:
            await self._fail(context, "announce", "transport", grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except BaseNotHeld as exc:
            await self._fail(context, "announce", "patch_base", grpc.StatusCode.FAILED_PRECONDITION, str(exc))

    async def Report(self, request, context):
        """How a collective went for the trainer or a member: a failure ends the epoch."""
        self.transfers.report(request)
        return common_pb2.Empty()

    async def _rendezvous(self, context, call):
        """One rendezvous call, its refusals as statuses: a malformed request INVALID_ARGUMENT, a key
        space not open or past its bounds PERMISSION_DENIED, a key not set in time DEADLINE_EXCEEDED."""
        try:
            return await call()
        except RendezvousRequestError as exc:
            await self._fail(context, "rendezvous", "invalid", grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except RendezvousError as exc:
            await self._fail(context, "rendezvous", "refused", grpc.StatusCode.PERMISSION_DENIED, str(exc))
        except TimeoutError as exc:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))

    async def RendezvousPut(self, request, context):
        async def put():
            self.transfers.rendezvous.put(request.epoch, request.rendezvous, request.key, request.value, request.job)
            return common_pb2.Empty()

        return await self._rendezvous(context, put)

    async def RendezvousWait(self, request, context):
        async def wait():
            value = await self.transfers.rendezvous.wait_async(
                request.epoch, request.rendezvous, request.key, request.timeout_seconds, request.job
            )
            return pb.RendezvousValue(value=value)

        return await self._rendezvous(context, wait)

    async def RendezvousAdd(self, request, context):
        async def add():
            amount = parse_amount(request.value)
            total = self.transfers.rendezvous.add(request.epoch, request.rendezvous, request.key, amount, request.job)
            return pb.RendezvousValue(value=str(total).encode())

        return await self._rendezvous(context, add)

    async def Pull(self, request, context):
        started = time.perf_counter()
        latest = self.store.latest
        version = request.version or (latest.manifest.version if latest else 0)
        if version not in self.store.versions:
            await self._fail(context, "pull", "not_found", grpc.StatusCode.NOT_FOUND, f"version {version} is not held")
        target = self.store.versions[version]
        for waited in (target, self.store.versions.get(request.base_version)):
            if waited is not None and waited.ready is not None:  # a patch version being made whole
                await waited.ready.wait()
        if version not in self.store.versions:
            await self._fail(context, "pull", "not_found", grpc.StatusCode.NOT_FOUND, f"version {version} is not held")
        base_version = request.base_version if request.base_version in self.store.versions else 0
        try:
            payloads = self.store.payloads(version)
            base = self.store.payloads(base_version) if base_version else None
        except (OSError, WeightError) as exc:  # a shared-memory file gone or changed since it was announced
            await self._fail(context, "pull", "data_loss", grpc.StatusCode.DATA_LOSS, f"version {version}: {exc}")
        base_specs = (
            {s.name: (i, s) for i, s in enumerate(self.store.versions[base_version].manifest.tensors)} if base else {}
        )
        encoded = []
        for spec, data in zip(target.manifest.tensors, payloads, strict=True):
            index, base_spec = base_specs.get(spec.name, (None, None))
            same_layout = (
                base_spec is not None and base_spec.dtype == spec.dtype and list(base_spec.shape) == list(spec.shape)
            )
            base_data = base[index] if same_layout else None
            encoded.append(encode_delta(data, base_data, same_layout and base_spec.checksum == spec.checksum))
        header = pb.PullHeader(
            manifest=target.manifest,
            encodings=[e for e, _ in encoded],
            encoded_nbytes=[len(w) for _, w in encoded],
            base_version=base_version,
        )
        yield pb.PullResponse(header=header)
        stripes = max(request.stripes, 1)
        stripe = request.stripe
        if stripe >= stripes:
            await self._fail(
                context, "pull", "bad_stripe", grpc.StatusCode.INVALID_ARGUMENT, f"stripe {stripe} of {stripes}"
            )
        sent = 0
        sequence = 0
        step = self.settings.chunk_bytes
        for index, (_, wire) in enumerate(encoded):
            view = memoryview(wire)
            for offset in range(0, len(view), step):
                if sequence % stripes == stripe:
                    data = view[offset : offset + step]
                    sent += len(data)
                    yield encode_chunk_frame(index, offset, data)
                sequence += 1
        BYTES_PULLED.inc(sent)
        PULL_SECONDS.labels("delta" if base_version else "full").observe(time.perf_counter() - started)

    async def Latest(self, request, context):
        latest = self.store.latest
        if latest is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "no version has been published yet")
        return latest.info()

    async def List(self, request, context):
        return pb.VersionList(versions=[self.store.versions[v].info() for v in sorted(self.store.versions)])


async def weightsync_instance(settings: WeightSyncSettings) -> str:
    """The run instance weight-sync holds versions to: its `run_instance`, else the run's in Redis
    when `redis_url` is set; else none (logged: an earlier run's version is then taken)."""
    if settings.run_instance or "redis_url" not in settings.model_fields_set:
        if not settings.run_instance:
            log.warning("event=run_instance_unknown detail=no redis_url: versions of an earlier run are not refused")
        return settings.run_instance
    client = settings.redis()
    try:
        instance = await resolve_instance(settings, client)
    finally:
        await client.aclose()
    log.info("event=run_instance instance=%s", instance)
    return instance


def _serialize_pull(item: pb.PullResponse | bytes) -> bytes:
    return item if isinstance(item, bytes) else item.SerializeToString()


class _PreEncodedPull:
    """Registers the generated handlers, with Pull also accepting pre-serialised chunk frames."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self.server = server

    def add_generic_rpc_handlers(self, handlers) -> None:
        pass  # registered below, once the Pull handler has been swapped

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        handlers = {**handlers, "Pull": handlers["Pull"]._replace(response_serializer=_serialize_pull)}
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
        self.server.add_registered_method_handlers(service, handlers)


def add_servicer(servicer: WeightSyncServicer, server: grpc.aio.Server) -> None:
    weightsync_pb2_grpc.add_WeightSyncServicer_to_server(servicer, _PreEncodedPull(server))


class WeightSyncService(ServiceLifecycle):
    """Weight-sync on the service lifecycle: it serves its API until stopped; no loop of its own."""

    name = "weightsync"

    def __init__(self, settings: WeightSyncSettings) -> None:
        self.settings = settings

    def listen(self) -> Listen:
        s = self.settings
        return Listen(s.host, s.port, s.max_message_bytes, s.metrics_port, s.run_id)

    async def setup(self) -> Api:
        servicer = WeightSyncServicer(self.settings)
        if servicer.verifier is not None:
            servicer.verifier.instance = await weightsync_instance(self.settings)
        return Api([(add_servicer, servicer)], ["steadyrl.v1.WeightSync"], {"signed": servicer.verifier is not None})

    def loops(self, stop: asyncio.Event) -> dict[str, Coroutine]:
        return {}


async def serve(
    settings: WeightSyncSettings, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None
) -> None:
    """Run until `stop` is set (or forever)."""
    await serve_service(WeightSyncService(settings), ready, stop)
