"""The `shm` transport, both ends: the trainer writes each version once as a safetensors file in shared memory
(`/dev/shm`) and announces it; replicas on that host map the file and apply it tensor by tensor, each checked against
the manifest before it is used. The files of the last `keep` versions are kept, older ones written over: a reader
still mapping a file that is written over reads bytes that fail their digest, refused, never served.

Details: docs/internals/weights.md"""

from __future__ import annotations

import asyncio
import json
import mmap
import os
import secrets
import stat
import struct
import warnings
from collections.abc import Awaitable, Callable, Iterator, Mapping
from pathlib import Path

import blake3
import numpy as np
import torch

from shared.rpc.steadyrl.v1 import weightsync_pb2 as pb
from shared.runtime.private_files import private_dir
from shared.weightsync.base import (
    WEIGHT_DTYPES,
    Bucket,
    Delivery,
    PublishOptions,
    Transport,
    TransportName,
    WeightError,
    WeightPublisher,
    as_tensor,
    batched,
)
from shared.weightsync.grpc import GrpcWeightPublisher
from shared.weightsync.manifest import (
    digest,
    empty_manifest,
    pieces,
    tensor_meta,
)
from shared.weightsync.patches import Patch, PatchEncoder, count_bytes, encode_version, patch_manifest

ST_DTYPES = {name: code for name, (_, code) in WEIGHT_DTYPES.items()}  # torch name → safetensors code
ALIGN = 64
CHUNK = 4 << 20


def _nbytes(dtype: str, shape: list[int]) -> int:
    return int(np.prod(shape, dtype=np.int64)) * getattr(torch, dtype).itemsize


def _layout(tensors: Mapping[str, torch.Tensor]) -> tuple[bytes, dict[str, dict], int]:
    """(the file's header bytes, name → its entry, the file's size)."""
    header: dict[str, dict] = {}
    offset = 0
    for name in tensors:
        dtype, shape = tensor_meta(tensors, name)
        if dtype not in ST_DTYPES:
            raise WeightError(f"tensor {name}: dtype {dtype} has no safetensors code")
        size = _nbytes(dtype, shape)
        header[name] = {"dtype": ST_DTYPES[dtype], "shape": shape, "data_offsets": [offset, offset + size]}
        offset = -(-(offset + size) // ALIGN) * ALIGN
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(len(raw) + 8) % ALIGN)  # the data starts aligned
    return struct.pack("<Q", len(raw)) + raw, header, 8 + len(raw) + max(offset, 1)


def write_shm(
    path: Path,
    tensors: Mapping[str, torch.Tensor],
    version: int,
    parent_version: int,
    signer=None,
    reuse: Path | None = None,
    digests: bool = True,
) -> pb.WeightManifest:
    """Write `tensors` to `path` as a safetensors file in one pass — each tensor materialised once,
    each chunk copied and hashed together — and return the (signed) manifest. Written under a
    temporary name and renamed, so a reader never maps half a file; `reuse`: an older version's
    file of the same size, renamed and written over (its pages stay in memory). `digests=False`:
    a file whose manifest is known already (the weight-sync service's spill to disk), unhashed."""
    head, header, size = _layout(tensors)
    start = len(head)
    manifest = empty_manifest(tensors, version, parent_version)
    try:
        private_dir(path.parent)  # 0700 and this user's: no one else can plant or swap a version file
    except PermissionError as exc:
        raise WeightError(f"the version folder: {exc}") from None
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    if reuse is not None and reuse.exists() and reuse.stat().st_size == size:
        os.replace(reuse, tmp)  # a file of this private folder: opened as it is, never through a link
        fd = os.open(tmp, os.O_RDWR | os.O_NOFOLLOW)
    else:
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.ftruncate(fd, size)
        os.pwrite(fd, head, 0)
        scratch = torch.empty(CHUNK, dtype=torch.uint8)
        for name in tensors:
            at = start + header[name]["data_offsets"][0]
            hasher = blake3.blake3() if digests else None
            for piece in pieces(tensors, name, scratch):
                _pwrite_all(fd, piece, at)
                if hasher is not None:
                    hasher.update(piece)
                at += len(piece)
            manifest.tensors.add(
                name=name,
                dtype=tensor_meta(tensors, name)[0],
                shape=header[name]["shape"],
                nbytes=at - start - header[name]["data_offsets"][0],
                checksum=hasher.digest() if hasher is not None else b"",
            )
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return signer.sign(manifest) if signer is not None else manifest


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        written = os.pwrite(fd, data, offset)
        data = data[written:]
        offset = offset + written


def map_version(path: str | Path) -> tuple[mmap.mmap, dict, int]:
    """A version file mapped (read-only), its safetensors header and where its data starts; a file
    gone (pruned since it was announced), empty, cut short or not a version file: WeightError, so
    the version is refused like a bad byte, never a dead loop."""
    try:
        # a link planted in its place is refused; a FIFO or a device never blocks the open
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(f"{path} is not a regular file")
            mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        (size,) = struct.unpack("<Q", mapped[:8])
        header = json.loads(mapped[8 : 8 + size])
    except (OSError, ValueError, struct.error) as exc:  # ValueError: an empty file, a bad header
        raise WeightError(f"version file {Path(path).name}: {exc}") from exc
    if not isinstance(header, dict) or 8 + size > len(mapped):
        raise WeightError(f"version file {Path(path).name}: not a safetensors header")
    return mapped, header, 8 + size


def shm_views(
    mapped: mmap.mmap, header: dict, start: int, manifest: pb.WeightManifest, verify: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor of a mapped version file as a view (read-only memory: copy it, never write it),
    checked against its manifest entry — name, dtype, shape, digest — before it is yielded; a
    patched tensor as its `Patch` (its patch's bytes checked against the patch's digest)."""
    buffer = np.frombuffer(mapped, dtype=np.uint8)
    for spec in manifest.tensors:
        patched = spec.HasField("patch")  # the file holds the patch's bytes, a U8 entry of their length
        dtype, shape, nbytes, checksum = (
            ("uint8", [spec.patch.nbytes], spec.patch.nbytes, spec.patch.checksum)
            if patched
            else (spec.dtype, list(spec.shape), spec.nbytes, spec.checksum)
        )
        entry = header.get(spec.name)
        if entry is None or entry["dtype"] != ST_DTYPES.get(dtype) or list(entry["shape"]) != shape:
            raise WeightError(f"tensor {spec.name}: the file does not hold it as the manifest says")
        begin, end = entry["data_offsets"]
        view = buffer[start + begin : start + end]
        if end - begin != nbytes or (verify and digest(view) != checksum):
            raise WeightError(f"tensor {spec.name}: checksum mismatch")
        if patched:
            yield spec.name, Patch(spec, view)
            continue
        with warnings.catch_warnings():  # a read-only view: torch warns it is not writable
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.from_numpy(view)
        yield spec.name, as_tensor(tensor, spec)


def read_shm(path: str | Path, manifest: pb.WeightManifest, verify: bool = True) -> dict[str, torch.Tensor]:
    """Every tensor of a version file, checked, as views of its mapping (read-only)."""
    mapped, header, start = map_version(path)
    return dict(shm_views(mapped, header, start, manifest, verify))


class ShmDelivery(Delivery):
    """A version in a shared-memory file. In process every tensor is checked before the first is
    applied (`prepare`, before the engine pauses; the bytes are already here: a bad one refuses the
    version whole); a vLLM worker checks each tensor as it loads it."""

    transport = TransportName.SHM

    def __init__(self, manifest: pb.WeightManifest, path: str) -> None:
        super().__init__(manifest)
        self.path = path
        self.checked: list[tuple[str, torch.Tensor]] | None = None

    def prepare(self) -> None:
        """Map the file and check every tensor (before the engine pauses: only the copy is paused)."""
        if self.checked is None:
            mapped, header, start = map_version(self.path)
            self.checked = list(shm_views(mapped, header, start, self.manifest))

    def buckets(self) -> Iterator[Bucket]:
        self.prepare()
        yield from batched(self.checked)

    def close(self) -> None:
        self.checked = None  # the views go, and with the last of them the mapping

    def worker_update(self) -> dict:
        return {"transport": str(self.transport), "path": self.path, "manifest": self.manifest.SerializeToString()}


def prune_shm(directory: Path, keep: int, current: int) -> Path | None:
    """Keep the newest `keep` version files up to `current` (the version just written); of the
    older ones, return the newest to be written over (its pages are in memory already) and delete
    the rest (a reader that mapped one keeps its pages). A file of a version above `current` is
    an earlier process's (a killed run of the same run id, a trainer resumed from an older
    checkpoint): deleted, or it would count among the newest and have `current` pruned at once."""
    for stale in directory.glob(".v*.safetensors.*.tmp"):  # a write a crash cut short (none is under way)
        stale.unlink(missing_ok=True)
    files = []
    for version, path in sorted((int(p.stem[1:]), p) for p in directory.glob("v*.safetensors")):
        if version > current:
            path.unlink(missing_ok=True)
        else:
            files.append(path)
    old = files[:-keep] if keep else files
    for path in old[:-1]:
        path.unlink(missing_ok=True)
    return old[-1] if old else None


class ShmWeightPublisher(WeightPublisher):
    """Each version written once to `directory/v<version>.safetensors`, over the file of one older
    than the newest `keep`, then announced."""

    def __init__(
        self, grpc_publisher: GrpcWeightPublisher, directory: Path, keep: int = 4, patches: bool = False
    ) -> None:
        self.grpc = grpc_publisher
        self.directory = directory
        self.keep = keep
        self.spare: Path | None = None
        self.encoder = PatchEncoder() if patches else None  # patches: the last version published, kept
        self.last_manifest: pb.WeightManifest | None = None

    async def push(
        self, tensors: Mapping[str, torch.Tensor], version: int, parent_version: int = 0, timeout: float | None = 600.0
    ) -> pb.AnnounceReply:
        return await (await self.stage(tensors, version, parent_version, timeout))()

    async def stage(
        self, tensors: Mapping[str, torch.Tensor], version: int, parent_version: int = 0, timeout: float | None = 600.0
    ) -> Callable[[], Awaitable[pb.AnnounceReply]]:
        """The file written (the tensors read); its completion announces it and prunes the old ones."""
        path = self.directory / f"v{version}.safetensors"
        if self.encoder is None:
            manifest = await asyncio.to_thread(
                write_shm, path, tensors, version, parent_version, self.grpc.signer, self.spare
            )
        else:
            manifest = await asyncio.to_thread(self._write_patched, path, tensors, version, parent_version)
        count_bytes(manifest)
        self.last_manifest = manifest  # what the last version staged sent (its patches, its whole tensors)

        async def announce() -> pb.AnnounceReply:
            try:
                reply = await self.grpc.stub.Announce(
                    pb.AnnounceRequest(manifest=manifest, transport=pb.Transport(kind=pb.SHM, shm_path=str(path))),
                    wait_for_ready=True,
                    timeout=timeout,
                )
            except BaseException:
                if self.encoder is not None:  # not out: the next version goes whole
                    self.encoder.reset()
                raise
            self.spare = prune_shm(self.directory, self.keep, version)
            return reply

        return announce

    def _write_patched(
        self, path: Path, tensors: Mapping[str, torch.Tensor], version: int, parent_version: int
    ) -> pb.WeightManifest:
        """The version read once through the encoder and its file written: each tensor's patch
        against the last version published, or the tensor whole; the manifest holds every tensor's
        full digest and each patch's."""
        try:
            base, specs, payloads = encode_version(tensors, self.encoder)
            write_shm(path, payloads, version, parent_version, reuse=self.spare, digests=False)
        except BaseException:
            self.encoder.reset()
            raise
        self.encoder.version = version
        return patch_manifest(tensors, version, parent_version, base, specs, self.grpc.signer)

    async def close(self) -> None:
        await self.grpc.close()


class ShmTransport(Transport):
    name = TransportName.SHM

    def publisher(self, grpc: GrpcWeightPublisher, options: PublishOptions) -> WeightPublisher:
        if options.shm_dir is None:
            raise ValueError("the shm transport needs a directory in shared memory")
        return ShmWeightPublisher(grpc, options.shm_dir, options.shm_keep, options.patches)

    def delivery(self, announcement: pb.VersionAnnouncement, subscriber) -> Delivery:
        return ShmDelivery(announcement.manifest, announcement.transport.shm_path)

    def worker_buckets(self, update, manifest: pb.WeightManifest, worker) -> Iterator[Bucket]:
        mapped, header, start = map_version(update.path)
        return batched(shm_views(mapped, header, start, manifest))


TRANSPORT = ShmTransport()
