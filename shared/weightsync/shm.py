"""The `shm` transport: the trainer writes each version once as a safetensors file in shared
memory (`/dev/shm`), digesting each tensor as it writes it, and announces it; replicas on that
host map the file (private, copy-on-write) and read tensors straight from the mapping."""

from __future__ import annotations

import asyncio
import json
import mmap
import os
import struct
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from shared.interfaces import WeightPublisher
from shared.rpc.steadyrl.v1 import weightsync_pb2 as pb
from shared.weightsync.grpc import GrpcWeightPublisher
from shared.weightsync.manifest import CHECKSUM_ALGO, WeightError, digest, sign, tensor_to_bytes

ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64", "int64": "I64",
             "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}
ALIGN = 64


def tensor_meta(tensors: Mapping[str, torch.Tensor], name: str) -> tuple[str, list[int]]:
    """(dtype name, shape) of `tensors[name]`, without casting or gathering it when the mapping
    can tell (`meta(name)`), else from the tensor itself."""
    meta = getattr(tensors, "meta", None)
    if meta is not None:
        return meta(name)
    tensor = tensors[name]
    return str(tensor.dtype).removeprefix("torch."), list(tensor.shape)


def _nbytes(dtype: str, shape: list[int]) -> int:
    return int(np.prod(shape, dtype=np.int64)) * getattr(torch, dtype).itemsize


def write_shm(path: Path, tensors: Mapping[str, torch.Tensor], version: int, parent_version: int,
              key: bytes | None = None) -> pb.WeightManifest:
    """Write `tensors` to `path` as a safetensors file in one pass — each tensor materialised once,
    written, digested — and return the (signed) manifest. Written under a temporary name and
    renamed, so a reader never maps half a file."""
    import time

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
    start = 8 + len(raw)
    manifest = pb.WeightManifest(version=version, parent_version=parent_version, checksum_algo=CHECKSUM_ALGO,
                                 created_unix_ms=int(time.time() * 1000))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w+b") as f:
        f.truncate(start + max(offset, 1))
        with mmap.mmap(f.fileno(), start + max(offset, 1)) as mapped:
            mapped[:start] = struct.pack("<Q", len(raw)) + raw
            for name in tensors:
                data = tensor_to_bytes(tensors[name])
                begin, end = header[name]["data_offsets"]
                mapped[start + begin : start + end] = data
                manifest.tensors.add(name=name, dtype=tensor_meta(tensors, name)[0], shape=header[name]["shape"],
                                     nbytes=len(data), checksum=digest(data))
    os.replace(tmp, path)
    if key:
        manifest.signature = sign(manifest, key)
    return manifest


def read_shm(path: str | Path, manifest: pb.WeightManifest, verify: bool = True) -> dict[str, torch.Tensor]:
    """The tensors of a version file, as views of a private (copy-on-write) mapping of it, each
    checked against the manifest: name, dtype, shape and digest. WeightError on any mismatch."""
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    (size,) = struct.unpack("<Q", mapped[:8])
    header = json.loads(mapped[8 : 8 + size])
    start = 8 + size
    buffer = np.frombuffer(mapped, dtype=np.uint8)
    out: dict[str, torch.Tensor] = {}
    for spec in manifest.tensors:
        entry = header.get(spec.name)
        if entry is None or entry["dtype"] != ST_DTYPES.get(spec.dtype) or list(entry["shape"]) != list(spec.shape):
            raise WeightError(f"tensor {spec.name}: the file does not hold it as the manifest says")
        begin, end = entry["data_offsets"]
        view = buffer[start + begin : start + end]
        if end - begin != spec.nbytes or (verify and digest(view) != spec.checksum):
            raise WeightError(f"tensor {spec.name}: checksum mismatch")
        out[spec.name] = torch.from_numpy(view).view(getattr(torch, spec.dtype)).reshape(list(spec.shape))
    return out


def prune_shm(directory: Path, keep: int) -> None:
    """Delete all but the newest `keep` version files (a reader that mapped one keeps its pages)."""
    files = sorted(directory.glob("v*.safetensors"), key=lambda p: int(p.stem[1:]))
    for old in files[:-keep] if keep else files:
        old.unlink(missing_ok=True)


class ShmWeightPublisher(WeightPublisher):
    """Each version written once to `directory/v<version>.safetensors` (digests taken as it is
    written), then announced; the newest `keep` files are kept."""

    def __init__(self, grpc_publisher: GrpcWeightPublisher, directory: Path, keep: int = 4) -> None:
        self.grpc, self.directory, self.keep = grpc_publisher, directory, keep

    async def push(self, tensors: Mapping[str, torch.Tensor], version: int, parent_version: int = 0,
                   timeout: float | None = 600.0) -> pb.AnnounceReply:
        path = self.directory / f"v{version}.safetensors"
        manifest = await asyncio.to_thread(write_shm, path, tensors, version, parent_version, self.grpc.key)
        reply = await self.grpc.stub.Announce(pb.AnnounceRequest(
            manifest=manifest, transport=pb.Transport(kind=pb.SHM, shm_path=str(path))),
            wait_for_ready=True, timeout=timeout)
        prune_shm(self.directory, self.keep)
        return reply

    async def close(self) -> None:
        await self.grpc.close()
