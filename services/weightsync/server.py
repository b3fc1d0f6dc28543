"""gRPC servicer of the weight-sync service and its main loop."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
from prometheus_client import Counter, Gauge, Histogram

from services.weightsync.config import WeightSyncSettings
from services.weightsync.store import VersionStore
from shared.rpc.steadyrl.v1 import weightsync_pb2 as pb
from shared.rpc.steadyrl.v1 import weightsync_pb2_grpc
from shared.service_main import grpc_service, run_loops
from shared.weights import (
    Assembler,
    WeightError,
    encode_chunk_frame,
    encode_delta,
    validate_manifest,
    verify_payloads,
    verify_signature,
)

log = logging.getLogger("steadyrl.weightsync")

VERSIONS_HELD = Gauge("steadyrl_weightsync_versions_held", "Versions retained (memory + disk)")
LATEST_VERSION = Gauge("steadyrl_weightsync_latest_version", "Newest complete version")
BYTES_PUSHED = Counter("steadyrl_weightsync_pushed_bytes_total", "Bytes received by Push")
BYTES_PULLED = Counter("steadyrl_weightsync_pulled_bytes_total", "Bytes sent by Pull (wire bytes)")
PUSH_SECONDS = Histogram("steadyrl_weightsync_push_seconds", "Duration of successful pushes")
PULL_SECONDS = Histogram("steadyrl_weightsync_pull_seconds", "Duration of completed pulls", ["mode"])
SUBSCRIBERS = Gauge("steadyrl_weightsync_subscribers", "Open Watch streams")
FAILURES = Counter("steadyrl_weightsync_failures_total", "Failed pushes and pulls", ["op", "reason"])


class WeightSyncServicer(weightsync_pb2_grpc.WeightSyncServicer):
    def __init__(self, settings: WeightSyncSettings) -> None:
        self.settings = settings
        self.key = settings.signing_key()
        self.store = VersionStore(settings.retain_versions, settings.memory_versions, settings.spill_dir)
        self.changed = asyncio.Condition()

    async def _fail(self, context, op: str, reason: str, code: grpc.StatusCode, message: str):
        FAILURES.labels(op, reason).inc()
        log.warning("event=%s_failed reason=%s detail=%s", op, reason, message)
        await context.abort(code, message)

    async def Push(self, request_iterator, context):
        started = time.perf_counter()
        manifest, assembler, received = None, None, 0
        try:
            async for item in request_iterator:
                if manifest is None:
                    if not item.HasField("manifest"):
                        raise WeightError("the first message of a push must be the manifest")
                    manifest = item.manifest
                    validate_manifest(manifest, self.settings.max_version_bytes)
                    try:
                        verify_signature(manifest, self.key)
                    except WeightError as exc:
                        await self._fail(context, "push", "signature", grpc.StatusCode.PERMISSION_DENIED, str(exc))
                    latest = self.store.latest
                    if latest is not None and manifest.version <= latest.manifest.version:
                        await self._fail(
                            context, "push", "stale_version", grpc.StatusCode.FAILED_PRECONDITION,
                            f"version {manifest.version} is not newer than {latest.manifest.version}",
                        )
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
            await self._fail(context, "push", "invalid", grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except asyncio.CancelledError:
            FAILURES.labels("push", "cancelled").inc()
            log.warning("event=push_failed reason=cancelled version=%s bytes=%d", manifest and manifest.version, received)
            raise
        BYTES_PUSHED.inc(received)
        async with self.changed:
            self.store.add(manifest, payloads)
            self.changed.notify_all()
        VERSIONS_HELD.set(len(self.store.versions))
        LATEST_VERSION.set(manifest.version)
        PUSH_SECONDS.observe(time.perf_counter() - started)
        log.info("event=version_published version=%d bytes=%d tensors=%d", manifest.version, received, len(manifest.tensors))
        return pb.PushReply(version=self.store.versions[manifest.version].info().version, bytes_received=received)

    def _latest_version(self) -> int:
        latest = self.store.latest
        return latest.manifest.version if latest else 0

    async def Watch(self, request, context):
        SUBSCRIBERS.inc()
        seen = request.after_version
        try:
            while True:
                async with self.changed:
                    await self.changed.wait_for(lambda after=seen: self._latest_version() > after)
                    info = self.store.latest.info()
                seen = info.version.version
                yield pb.VersionAnnouncement(version=info.version, total_bytes=info.total_bytes)
        finally:
            SUBSCRIBERS.dec()

    async def Pull(self, request, context):
        started = time.perf_counter()
        latest = self.store.latest
        version = request.version or (latest.manifest.version if latest else 0)
        if version not in self.store.versions:
            await self._fail(context, "pull", "not_found", grpc.StatusCode.NOT_FOUND, f"version {version} is not held")
        target = self.store.versions[version]
        payloads = self.store.payloads(version)
        base_version = request.base_version if request.base_version in self.store.versions else 0
        base = self.store.payloads(base_version) if base_version else None
        base_specs = {s.name: (i, s) for i, s in enumerate(self.store.versions[base_version].manifest.tensors)} if base else {}
        encoded = []
        for spec, data in zip(target.manifest.tensors, payloads, strict=True):
            index, base_spec = base_specs.get(spec.name, (None, None))
            same_layout = base_spec is not None and base_spec.dtype == spec.dtype and list(base_spec.shape) == list(spec.shape)
            base_data = base[index] if same_layout else None
            encoded.append(encode_delta(data, base_data, same_layout and base_spec.checksum == spec.checksum))
        header = pb.PullHeader(
            manifest=target.manifest,
            encodings=[e for e, _ in encoded],
            encoded_nbytes=[len(w) for _, w in encoded],
            base_version=base_version,
        )
        yield pb.PullResponse(header=header)
        stripes, stripe = max(request.stripes, 1), request.stripe
        if stripe >= stripes:
            await self._fail(context, "pull", "bad_stripe", grpc.StatusCode.INVALID_ARGUMENT,
                             f"stripe {stripe} of {stripes}")
        sent, sequence, step = 0, 0, self.settings.chunk_bytes
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


async def serve(settings: WeightSyncSettings, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None) -> None:
    """Run until `stop` is set (or forever)."""
    servicer = WeightSyncServicer(settings)
    stop = stop or asyncio.Event()
    async with grpc_service("weightsync", [(add_servicer, servicer)], ["steadyrl.v1.WeightSync"], settings.host,
                            settings.port, settings.max_message_bytes, settings.metrics_port, ready,
                            signed=servicer.key is not None) as serving:
        await run_loops({}, stop, serving.health)
