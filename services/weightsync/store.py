"""The versions held: the newest in memory, older retained ones spilled to disk as safetensors;
a version that came through shared memory is read from its file (the trainer's) when pulled."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from shared.rpc.steadyrl.v1 import common_pb2
from shared.rpc.steadyrl.v1 import weightsync_pb2 as pb
from shared.weightsync.manifest import bytes_to_tensor, tensor_to_bytes


@dataclass
class StoredVersion:
    manifest: pb.WeightManifest
    payloads: list[bytearray] | None  # None once spilled (or when shm-backed)
    path: Path | None = None
    shm_path: Path | None = None  # the trainer's shared-memory file of this version

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.manifest.tensors)

    def info(self) -> pb.VersionInfo:
        m = self.manifest
        return pb.VersionInfo(
            version=common_pb2.PolicyVersion(version=m.version, parent_version=m.parent_version, created_unix_ms=m.created_unix_ms),
            total_bytes=self.total_bytes,
            num_tensors=len(m.tensors),
            on_disk=self.payloads is None,
        )


class VersionStore:
    def __init__(self, retain: int, in_memory: int, spill_dir: Path) -> None:
        self.retain, self.in_memory, self.spill_dir = retain, min(in_memory, retain), spill_dir
        self.versions: dict[int, StoredVersion] = {}

    @property
    def latest(self) -> StoredVersion | None:
        return self.versions[max(self.versions)] if self.versions else None

    def add_shm(self, manifest: pb.WeightManifest, path: Path) -> None:
        """A version whose bytes stay in the trainer's shared-memory file."""
        self.versions[manifest.version] = StoredVersion(manifest, None, shm_path=path)
        self._trim()

    def add(self, manifest: pb.WeightManifest, payloads: list[bytearray]) -> None:
        self.versions[manifest.version] = StoredVersion(manifest, payloads)
        self._trim()

    def make_room(self) -> None:
        """Before a version arrives: spill the oldest in-memory versions so that, with it, no more
        than `in_memory` versions are ever held in memory (the one arriving counts)."""
        held = sorted((v for v, stored in self.versions.items() if stored.payloads is not None), reverse=True)
        for version in held[max(self.in_memory - 1, 0):]:
            self._spill(self.versions[version])

    def memory_bytes(self) -> int:
        return sum(s.total_bytes for s in self.versions.values() if s.payloads is not None)

    def _trim(self) -> None:
        ordered = sorted(self.versions, reverse=True)
        for version in ordered[self.retain :]:
            dropped = self.versions.pop(version)
            if dropped.path is not None:
                shutil.rmtree(dropped.path, ignore_errors=True)
        for version in ordered[self.in_memory : self.retain]:
            if self.versions[version].shm_path is None:
                self._spill(self.versions[version])

    def payloads(self, version: int) -> list[bytearray]:
        """The raw bytes of every tensor (verified against the manifest when read from shm)."""
        stored = self.versions[version]
        if stored.payloads is not None:
            return stored.payloads
        if stored.shm_path is not None:
            from shared.weightsync.shm import read_shm

            tensors = read_shm(stored.shm_path, stored.manifest)
            return [tensor_to_bytes(tensors[spec.name]) for spec in stored.manifest.tensors]
        from safetensors.torch import load_file

        assert stored.path is not None
        tensors = load_file(stored.path / "weights.safetensors")
        return [bytearray(tensor_to_bytes(tensors[spec.name])) for spec in stored.manifest.tensors]

    def _spill(self, stored: StoredVersion) -> None:
        if stored.payloads is None:
            return
        from safetensors.torch import save_file

        path = self.spill_dir / f"v{stored.manifest.version}"
        path.mkdir(parents=True, exist_ok=True)
        tensors = {
            spec.name: bytes_to_tensor(data, spec.dtype, list(spec.shape))
            for spec, data in zip(stored.manifest.tensors, stored.payloads, strict=True)
        }
        save_file(tensors, str(path / "weights.safetensors"))
        stored.path, stored.payloads = path, None
