"""Rank 1 of each collective epoch: this service receives the broadcast version itself, checks
every bucket against the signed manifest, keeps it for gRPC pulls, and tells the subscribers the
broadcast did not reach to pull it. A failure (a dead member, a timeout, corrupted bytes) ends the
epoch; the trainer then pushes the version over gRPC."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from prometheus_client import Counter, Histogram

from services.weightsync.members import Membership
from services.weightsync.rendezvous import Rendezvous
from services.weightsync.store import VersionStore
from shared.rpc.steadyrl.v1 import weightsync_pb2 as pb
from shared.weightsync.base import WeightError, kind
from shared.weightsync.patches import base_by_name, made_whole

log = logging.getLogger("steadyrl.weightsync")
RECEIVED_BYTES = Counter("steadyrl_weightsync_collective_received_bytes_total", "Bytes received by broadcast")
RECEIVE_SECONDS = Histogram("steadyrl_weightsync_collective_receive_seconds", "Duration of received broadcasts")
FAILED = Counter("steadyrl_weightsync_collective_failures_total", "Collective transfers that failed", ["reason"])


def patch_base(manifest: pb.WeightManifest, store: VersionStore) -> dict:
    """A patch version's base by tensor name, (entry, bytes) ({} for a whole version; WeightError: not held)."""
    if not manifest.patch_base:
        return {}
    held = store.versions.get(manifest.patch_base)
    if held is None:
        raise WeightError(f"version {manifest.patch_base}, the base of {manifest.version}, is not held")
    return base_by_name(held.manifest, store.payloads(manifest.patch_base))


class CollectiveReceiver:
    def __init__(
        self,
        store: VersionStore,
        members: Membership,
        rendezvous: Rendezvous,
        stored: Callable[[pb.WeightManifest, frozenset[str]], None],
        latest: Callable[[], int],
    ) -> None:
        self.store = store
        self.members = members
        self.rendezvous = rendezvous
        self.stored = stored
        self.latest = latest
        self._groups = None  # made on the first collective (torch.distributed imported then)
        self._staging = None
        self._receiving: asyncio.Task | None = None

    def start(self, manifest: pb.WeightManifest, transport: pb.Transport, members: frozenset[str]) -> None:
        """Receive `manifest`'s version as rank 1 of `transport`'s epoch, in the background."""
        self._start_groups()
        self._receiving = asyncio.create_task(self._receive(manifest, transport, members))

    async def settled(self) -> None:
        """Wait for a broadcast still being received (bounded by the collective timeout)."""
        if self._receiving is not None:
            await asyncio.wait({self._receiving})

    def _start_groups(self) -> None:
        if self._groups is None:
            from shared.weightsync.collective import Groups, Staging

            self._groups = Groups(self.rendezvous)  # rank 1 reaches the rendezvous in process
            self._staging = Staging()  # what arrives is copied out before the next version: one set serves all

    async def _receive(self, manifest, transport: pb.Transport, members: frozenset[str]) -> None:
        """Rank 1 of a collective: receive, verify, keep; tell the others to pull. A failure ends
        the epoch (the trainer then pushes the version over gRPC)."""
        from shared.weightsync.collective import receive_buckets

        started = time.perf_counter()
        try:

            def work():  # each bucket copied out of the ring into the version this service keeps
                listed = self.store.versions.get(manifest.version)
                if listed is None or listed.ready is None:  # a patch version made its room as it was announced:
                    self.store.make_room()  # again, with it listed, would let go of its base (retain 2)
                group = self._groups.get(transport, 1)
                base = patch_base(manifest, self.store)
                specs = {spec.name: spec for spec in manifest.tensors}
                kept = {
                    name: made_whole(specs[name], item, base)
                    for bucket in receive_buckets(group, transport, manifest, self._staging)
                    for name, item in bucket
                }
                return [kept[spec.name] for spec in manifest.tensors]

            payloads = await asyncio.to_thread(work)
        except Exception as exc:  # noqa: BLE001 - a dead member, a timeout, corrupted bytes
            FAILED.labels(type(exc).__name__).inc()
            self.store.discard_pending(manifest.version)
            self._groups.drop()
            gone = self.members.fail(transport.epoch, manifest.version)
            log.warning(
                "event=collective_failed version=%d epoch=%d error=%s left=%s",
                manifest.version,
                transport.epoch,
                exc,
                gone,
            )
            return
        finally:
            self._receiving = None
        pending = self.store.versions.get(manifest.version)
        if pending is not None and pending.ready is not None:  # a patch version, listed since it was announced
            self.store.complete(manifest.version, payloads)
            self.stored(manifest, skip=members)
        elif manifest.version > self.latest():
            self.store.add(manifest, payloads)
            self.stored(manifest, skip=members)
        RECEIVED_BYTES.inc(sum(len(p) for p in payloads))
        RECEIVE_SECONDS.observe(time.perf_counter() - started)
        log.info(
            "event=version_published version=%d kind=%s transport=collective epoch=%d bytes=%d",
            manifest.version,
            kind(manifest),
            transport.epoch,
            sum(len(p) for p in payloads),
        )
