"""The versions announced off the gRPC push path: a shared-memory file the trainer wrote (this
service reads it to serve pulls), or a collective broadcast to the members of an epoch
(`members.py`), which this service joins as rank 1 (`collective_receiver.py`); each epoch's group
forms through this service's own rendezvous (`rendezvous.py`). How each collective went, as the
trainer and the members report it."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from pathlib import Path

from prometheus_client import Gauge

from services.weightsync.collective_receiver import FAILED, CollectiveReceiver
from services.weightsync.config import WeightSyncSettings
from services.weightsync.members import COLLECTIVE, SHM, Membership
from services.weightsync.rendezvous import Rendezvous
from services.weightsync.store import VersionStore
from shared.rpc.steadyrl.v1 import common_pb2
from shared.rpc.steadyrl.v1 import weightsync_pb2 as pb
from shared.weightsync.base import WeightError, kind
from shared.weightsync.patches import patched_bytes

log = logging.getLogger("steadyrl.weightsync")
EPOCH = Gauge("steadyrl_weightsync_collective_epoch", "Current membership epoch of the collective group")
MEMBERS = Gauge("steadyrl_weightsync_collective_members", "Replicas in the current collective epoch")


class BaseNotHeld(Exception):
    """A patch version this service cannot make whole: its base is not held (FAILED_PRECONDITION)."""


def whole_from_file(
    manifest: pb.WeightManifest, path: Path, base_manifest: pb.WeightManifest, base_payloads
) -> list[bytearray]:
    """Every tensor of a patch version, whole: its file's tensors as they are, its patches applied
    to the base version's bytes (`base_payloads()`), each checked against the manifest's digest."""
    from shared.weightsync.patches import base_by_name, made_whole
    from shared.weightsync.shm import read_shm

    held = read_shm(path, manifest)  # every tensor and patch checked against its digest
    base = base_by_name(base_manifest, base_payloads())
    return [made_whole(spec, held[spec.name], base) for spec in manifest.tensors]


class Transfers:
    def __init__(
        self,
        settings: WeightSyncSettings,
        store: VersionStore,
        members: Membership,
        stored: Callable[[pb.WeightManifest, frozenset[str]], None],
    ) -> None:
        self.settings = settings
        self.store = store
        self.members = members
        self.stored = stored
        self.host = socket.gethostname()
        self.rendezvous = Rendezvous(settings.collective_timeout_seconds)
        self.receiver = CollectiveReceiver(store, members, self.rendezvous, stored, self.latest)

    def latest(self) -> int:
        latest = self.store.latest
        return latest.manifest.version if latest else 0

    async def settled(self) -> None:
        """Wait for a broadcast still being received (bounded by the collective timeout)."""
        await self.receiver.settled()

    def shm_path(self, given: str) -> Path | None:
        """`given` resolved, if it is a file under this service's shm_dir (else None)."""
        path = Path(given).resolve()
        root = self.settings.shm_dir.resolve()
        return path if root in path.parents and path.is_file() else None

    async def announce(self, manifest: pb.WeightManifest, transport: pb.Transport) -> pb.AnnounceReply:
        """A version whose bytes travel off the push path, by the transport it names (ValueError:
        one this service cannot take so; BaseNotHeld: a patch against a version not held)."""
        if transport.kind == SHM:
            return await self.announce_shm(manifest, transport)
        if transport.kind == COLLECTIVE:
            return self.announce_collective(manifest, transport)
        raise ValueError("announce carries SHM or COLLECTIVE versions; gRPC versions are pushed")

    async def announce_shm(self, manifest: pb.WeightManifest, requested: pb.Transport) -> pb.AnnounceReply:
        """Held as the trainer's file (pulls read it), or, for a patch, made whole from the version it
        patches (its replicas that hold that version apply the patch meanwhile; the others pull it
        once it is whole)."""
        path = self.shm_path(requested.shm_path)
        if path is None:
            raise ValueError(f"{requested.shm_path} is not a file under {self.settings.shm_dir} on this host")
        if manifest.patch_base:
            base = self.store.versions.get(manifest.patch_base)
            if base is None or base.dropped:
                raise BaseNotHeld(
                    f"version {manifest.version} patches version {manifest.patch_base}, which this service "
                    "does not hold: publish it whole"
                )
            await asyncio.to_thread(self.store.make_room)
            self.store.add_pending(manifest)
        else:
            self.store.add_shm(manifest, path)
        mapped = {s.id for s in self.members.subscribers.values() if SHM in s.transports and s.host == self.host}
        for subscriber in self.members.subscribers.values():
            if subscriber.id in mapped:
                subscriber.queue.put_nowait(
                    pb.VersionAnnouncement(
                        version=self.store.versions[manifest.version].info().version,
                        manifest=manifest,
                        transport=pb.Transport(kind=SHM, shm_path=str(path)),
                    )
                )
        if manifest.patch_base:
            await self._make_whole(manifest, path)
        self.stored(manifest, skip=frozenset(mapped))
        whole, patched = patched_bytes(manifest)
        log.info(
            "event=version_published version=%d kind=%s transport=shm bytes=%d full_bytes=%d patch_bytes=%d "
            "patch_base=%d tensors=%d patched=%d mapped_by=%d",
            manifest.version,
            kind(manifest),
            self.store.versions[manifest.version].total_bytes,
            whole,
            patched,
            manifest.patch_base,
            len(manifest.tensors),
            sum(spec.HasField("patch") for spec in manifest.tensors),
            len(mapped),
        )
        return pb.AnnounceReply(
            version=self.store.versions[manifest.version].info().version,
            transport=pb.Transport(kind=SHM, shm_path=str(path)),
        )

    async def _make_whole(self, manifest: pb.WeightManifest, path: Path) -> None:
        """A patch version's bytes, from its base's and its file, held (BaseNotHeld when they
        cannot be made: the version is not held, and the trainer publishes it again whole)."""
        base = self.store.versions.get(manifest.patch_base)
        try:
            if base is None:
                raise WeightError(f"version {manifest.patch_base} was let go of")
            if base.ready is not None:
                await base.ready.wait()
            payloads = await asyncio.to_thread(
                whole_from_file, manifest, path, base.manifest, lambda: self.store.payloads(manifest.patch_base)
            )
        except (OSError, WeightError) as exc:
            self.store.discard(manifest.version)
            log.warning("event=patch_not_made version=%d base=%d error=%s", manifest.version, manifest.patch_base, exc)
            raise BaseNotHeld(f"version {manifest.version} could not be made from its patch: {exc}") from None
        self.store.complete(manifest.version, payloads)

    def announce_collective(self, manifest: pb.WeightManifest, requested: pb.Transport) -> pb.AnnounceReply:
        nccl = requested.backend == "nccl"  # a CPU service is no member of a GPU group: the trainer pushes too
        if manifest.patch_base:  # listed at once: a member that cannot apply the patch pulls it once whole
            base = self.store.versions.get(manifest.patch_base)
            if nccl or base is None or base.dropped:
                raise BaseNotHeld(
                    f"version {manifest.version} patches version {manifest.patch_base}, which this service "
                    f"{'receives no broadcast of' if nccl else 'does not hold'}: publish it whole"
                )
            self.store.make_room()
            self.store.add_pending(manifest)
        epoch = self.members.epoch_for_announce(requested.epoch)
        first = 1 if nccl else 2
        transport = pb.Transport(
            kind=COLLECTIVE,
            epoch=epoch.number,
            world_size=first + len(epoch.members),
            rank=0,
            rendezvous=self.rendezvous.open(epoch.number),
            bucket_bytes=self.settings.bucket_bytes,
            backend="nccl" if nccl else "gloo",
            timeout_seconds=self.settings.collective_timeout_seconds,
        )
        EPOCH.set(epoch.number)
        MEMBERS.set(len(epoch.members))
        version = pb.VersionAnnouncement(
            version=common_pb2.PolicyVersion(
                version=manifest.version,
                parent_version=manifest.parent_version,
                created_unix_ms=manifest.created_unix_ms,
            ),
            manifest=manifest,
        )
        for rank, member in enumerate(epoch.members, start=first):
            announcement = pb.VersionAnnouncement()
            announcement.CopyFrom(version)
            announcement.transport.CopyFrom(transport)
            announcement.transport.rank = rank
            self.members.subscribers[member].queue.put_nowait(announcement)
        if not nccl:
            mine = pb.Transport()
            mine.CopyFrom(transport)
            mine.rank = 1
            self.receiver.start(manifest, mine, frozenset(epoch.members))
        log.info(
            "event=version_announced version=%d transport=collective epoch=%d members=%d",
            manifest.version,
            epoch.number,
            len(epoch.members),
        )
        return pb.AnnounceReply(version=version.version, transport=transport)

    def report(self, request: pb.TransferReport) -> None:
        """How a collective went for the trainer or a member: a failure ends the epoch."""
        if request.ok:
            self.members.confirm(request.epoch, request.version, request.subscriber_id)
        else:
            FAILED.labels("reported").inc()
            gone = self.members.fail(request.epoch, request.version)
            log.warning(
                "event=collective_reported_failed version=%d epoch=%d by=%s error=%s left=%s",
                request.version,
                request.epoch,
                request.subscriber_id or "trainer",
                request.error[:200],
                gone,
            )
