"""The versions held: the newest in memory, older retained ones spilled to disk (the shm transport's version-file
layout, read back with every digest checked); a version that came through shared memory is read from its file.

Spills are written ahead by a thread, so no push or broadcast waits for a disk write, and memory never holds more
than `in_memory` versions, the arriving one counted. A version past `retain` is never written.

Details: docs/internals/weights.md"""

from __future__ import annotations

import asyncio
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

from shared.rpc.steadyrl.v1 import common_pb2
from shared.rpc.steadyrl.v1 import weightsync_pb2 as pb
from shared.weightsync.base import WeightError

SPILL_FILE = "weights.safetensors"


@dataclass
class StoredVersion:
    manifest: pb.WeightManifest
    payloads: list[bytearray] | None  # None once spilled (or when shm-backed)
    path: Path | None = None
    shm_path: Path | None = None  # the trainer's shared-memory file of this version
    dropped: bool = False  # past `retain`: no longer held (a write of it under way deletes its file)
    ready: asyncio.Event | None = None  # a patch version being made whole: set once its bytes are held

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.manifest.tensors)

    def info(self) -> pb.VersionInfo:
        m = self.manifest
        return pb.VersionInfo(
            version=common_pb2.PolicyVersion(
                version=m.version, parent_version=m.parent_version, created_unix_ms=m.created_unix_ms
            ),
            total_bytes=self.total_bytes,
            num_tensors=len(m.tensors),
            on_disk=self.payloads is None,
        )


class VersionStore:
    def __init__(self, retain: int, in_memory: int, spill_dir: Path) -> None:
        self.retain = retain
        self.in_memory = min(in_memory, retain)
        self.spill_dir = spill_dir
        self.versions: dict[int, StoredVersion] = {}
        self._disk = threading.Lock()  # one writer of spill files at a time (the write-ahead thread or a caller)

    @property
    def latest(self) -> StoredVersion | None:
        return self.versions[max(self.versions)] if self.versions else None

    def add_shm(self, manifest: pb.WeightManifest, path: Path) -> None:
        """A version whose bytes stay in the trainer's shared-memory file."""
        self.versions[manifest.version] = StoredVersion(manifest, None, shm_path=path)
        self._trim()
        self._write_ahead()

    def add_pending(self, manifest: pb.WeightManifest) -> StoredVersion:
        """A version whose bytes are being made (a patch applied to its base): listed, and pulled once
        `complete` (or let go of by `discard`)."""
        stored = self.versions[manifest.version] = StoredVersion(manifest, None, ready=asyncio.Event())
        self._trim()
        return stored

    def complete(self, version: int, payloads: list[bytearray]) -> None:
        """A pending version's bytes are held (if it is still listed)."""
        stored = self.versions.get(version)
        if stored is not None and stored.ready is not None:
            if not stored.dropped:
                stored.payloads = payloads
            stored.ready.set()
            stored.ready = None
            self._trim()
            self._write_ahead()

    def discard_pending(self, version: int) -> None:
        """`discard` of a version still pending (a whole one is left alone)."""
        stored = self.versions.get(version)
        if stored is not None and stored.ready is not None:
            self.discard(version)

    def discard(self, version: int) -> None:
        """A pending version that could not be made: no longer listed (a pull waiting on it finds so)."""
        stored = self.versions.pop(version, None)
        if stored is not None:
            stored.dropped = True
            if stored.ready is not None:
                stored.ready.set()

    def add(self, manifest: pb.WeightManifest, payloads: list[bytearray]) -> None:
        self.versions[manifest.version] = StoredVersion(manifest, payloads)
        self._trim()
        self._write_ahead()

    def _write_ahead(self) -> None:
        """Start writing, on a thread of its own, the files of what the next arrival spills."""
        ahead = self._to_spill()
        if ahead:
            threading.Thread(
                target=lambda: [self._write(stored) for stored in ahead], name="weightsync-spill", daemon=True
            ).start()

    def _next_drops(self) -> list[int]:
        """The versions the next arrival drops: beyond the newest `retain - 1`, never the newest
        (with `retain` 1 it is spilled, not let go of: a push that then fails leaves it servable)."""
        return sorted(self.versions, reverse=True)[max(self.retain - 1, 1) :]

    def _to_spill(self) -> list[StoredVersion]:
        """What the next arrival spills: the in-memory versions beyond the newest `in_memory - 1`,
        but none it drops (a file no one would read)."""
        drops = set(self._next_drops())
        held = sorted(
            (v for v, stored in self.versions.items() if stored.payloads is not None and v not in drops), reverse=True
        )
        return [self.versions[v] for v in held[max(self.in_memory - 1, 0) :]]

    def make_room(self) -> None:
        """Before a version arrives: let go of the versions it drops and spill the oldest in-memory
        ones, so that, with it, no more than `in_memory` versions are ever held in memory (the one
        arriving counts). Their files are written ahead already (else written now). A version let
        go of stays listed until the arrival (`_trim`, on the service's loop) and is no longer
        served."""
        for version in self._next_drops():
            stored = self.versions.get(version)
            if stored is not None and stored.payloads is not None:
                stored.dropped = stored.path is None  # on disk already: served from there until it goes
                stored.payloads = None
        for stored in self._to_spill():
            self._spill(stored)

    def memory_bytes(self) -> int:
        return sum(s.total_bytes for s in self.versions.values() if s.payloads is not None)

    def _trim(self) -> None:
        """Drop the versions past `retain`, never waiting on the disk (called on the service's loop;
        what is past `in_memory` is let go of by `make_room` before the next bytes arrive)."""
        for version in sorted(self.versions, reverse=True)[self.retain :]:
            dropped = self.versions.pop(version)
            dropped.dropped = True
            dropped.payloads = None  # a write of it under way deletes its own file
            shutil.rmtree(self.spill_dir / f"v{version}", ignore_errors=True)

    def payloads(self, version: int) -> list[bytearray]:
        """The raw bytes of every tensor (verified against the manifest when read from a file)."""
        stored = self.versions[version]
        if stored.payloads is not None:
            return stored.payloads
        if stored.ready is not None:
            raise WeightError(f"version {version} is still being made from its patch")
        if stored.dropped:
            raise WeightError(f"version {version} was let go of to make room for a newer one")
        from shared.weightsync.manifest import tensor_to_bytes  # torch: only a version read back from a file
        from shared.weightsync.shm import read_shm

        if stored.shm_path is not None:
            tensors = read_shm(stored.shm_path, stored.manifest)
            return [tensor_to_bytes(tensors[spec.name]) for spec in stored.manifest.tensors]
        from shared.weightsync.patches import as_whole

        assert stored.path is not None
        tensors = read_shm(stored.path / SPILL_FILE, as_whole(stored.manifest))  # the file holds it whole
        return [bytearray(tensor_to_bytes(tensors[spec.name])) for spec in stored.manifest.tensors]

    def _write(self, stored: StoredVersion) -> None:
        """Its spill file, unless written already (its bytes stay in memory)."""
        from shared.weightsync.manifest import bytes_to_tensor  # torch: only a version written to a file
        from shared.weightsync.shm import write_shm

        with self._disk:
            payloads = stored.payloads
            if stored.path is not None or payloads is None or stored.dropped:
                return
            path = self.spill_dir / f"v{stored.manifest.version}"
            tensors = {
                spec.name: bytes_to_tensor(data, spec.dtype, list(spec.shape))
                for spec, data in zip(stored.manifest.tensors, payloads, strict=True)
            }
            try:
                write_shm(
                    path / SPILL_FILE, tensors, stored.manifest.version, stored.manifest.parent_version, digests=False
                )  # the manifest has them: checked when read back
            except OSError:
                if not stored.dropped:  # else its directory was deleted under the write: nothing to keep
                    raise
            if stored.dropped:  # dropped while it was written: no one reads the file
                shutil.rmtree(path, ignore_errors=True)
                return
            stored.path = path

    def _spill(self, stored: StoredVersion) -> None:
        self._write(stored)
        stored.payloads = None
