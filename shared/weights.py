"""Versioned weights on the wire: manifests, per-tensor checksums, HMAC signatures, deltas.

Pure functions over bytes and tensors; the gRPC client helpers live in `shared.weightsync_client`.
A tensor travels as its raw little-endian bytes (bf16 included); its manifest entry carries
name, dtype, shape, byte size and a BLAKE3 digest (256 bits) of those bytes. BLAKE3 is a
cryptographic hash — collision-resistant, which the signed manifest relies on — and 4× faster
than SHA-256 here on one thread (7.3 vs 1.8 GiB/s), more on several.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Iterator, Mapping

import blake3
import numpy as np
import torch

from shared.rpc.steadyrl.v1 import weightsync_pb2 as pb

CHECKSUM_ALGO = "blake3"
ZSTD_LEVEL = 1


class WeightError(ValueError):
    """A manifest, chunk stream or signature that must not become a version."""


def tensor_to_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a tensor (CPU, contiguous), any dtype, without a copy where possible."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def bytes_to_tensor(data: bytes | bytearray | memoryview, dtype: str, shape: list[int]) -> torch.Tensor:
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise WeightError(f"unknown dtype {dtype!r}")
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
    return raw.view(torch_dtype).reshape(shape)


def digest(data: bytes | bytearray | memoryview) -> bytes:
    """BLAKE3-256 of `data` (several threads for large inputs)."""
    threads = blake3.blake3.AUTO if len(data) >= 1 << 22 else 1
    return blake3.blake3(data, max_threads=threads).digest()


class CastView(Mapping):
    """A model's tensors in the published dtype, cast one at a time on access: a push streams the
    version without a second copy of the model in memory."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype) -> None:
        self.tensors, self.dtype = tensors, dtype

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self.tensors[name].detach()
        return tensor.to(self.dtype) if tensor.is_floating_point() else tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def meta(self, name: str) -> tuple[str, list[int]]:
        """(dtype name, shape) of a tensor without casting it."""
        tensor = self.tensors[name]
        dtype = self.dtype if tensor.is_floating_point() else tensor.dtype
        return str(dtype).removeprefix("torch."), list(tensor.shape)


def describe(
    tensors: Mapping[str, torch.Tensor], version: int, parent_version: int, key: bytes | None = None
) -> pb.WeightManifest:
    """Manifest of `tensors` (name order kept), signed when `key` is given. Reads one tensor at a
    time and keeps none of their bytes: a mapping that materialises each tensor on access (a cast,
    a gather) is streamed, never copied whole."""
    manifest = pb.WeightManifest(
        version=version,
        parent_version=parent_version,
        checksum_algo=CHECKSUM_ALGO,
        created_unix_ms=int(time.time() * 1000),
    )
    for name in tensors:
        tensor = tensors[name]
        data = tensor_to_bytes(tensor)
        manifest.tensors.add(
            name=name,
            dtype=str(tensor.dtype).removeprefix("torch."),
            shape=list(tensor.shape),
            nbytes=len(data),
            checksum=digest(data),
        )
    if key:
        manifest.signature = sign(manifest, key)
    return manifest


def build_manifest(
    tensors: Mapping[str, torch.Tensor], version: int, parent_version: int, key: bytes | None = None
) -> tuple[pb.WeightManifest, list[memoryview]]:
    """`describe(tensors, ...)` and the raw bytes of every tensor (all held at once)."""
    return describe(tensors, version, parent_version, key), [tensor_to_bytes(tensors[name]) for name in tensors]


def _canonical(manifest: pb.WeightManifest) -> bytes:
    unsigned = pb.WeightManifest()
    unsigned.CopyFrom(manifest)
    unsigned.signature = b""
    return unsigned.SerializeToString(deterministic=True)


def sign(manifest: pb.WeightManifest, key: bytes) -> bytes:
    """HMAC-SHA256 over the manifest without its signature (deterministic serialisation)."""
    return hmac.new(key, _canonical(manifest), hashlib.sha256).digest()


def verify_signature(manifest: pb.WeightManifest, key: bytes | None) -> None:
    """Raise WeightError unless the manifest carries a valid signature (no-op without a key)."""
    if not key:
        return
    if not manifest.signature:
        raise WeightError("manifest is unsigned and a signing key is configured")
    if not hmac.compare_digest(manifest.signature, sign(manifest, key)):
        raise WeightError("manifest signature does not verify")


def validate_manifest(manifest: pb.WeightManifest, max_total_bytes: int) -> None:
    if manifest.version == 0:
        raise WeightError("version must be >= 1")
    if not manifest.tensors:
        raise WeightError("manifest lists no tensors")
    if manifest.checksum_algo != CHECKSUM_ALGO:
        raise WeightError(f"checksum_algo {manifest.checksum_algo!r}, expected {CHECKSUM_ALGO!r}")
    names = set()
    total = 0
    for spec in manifest.tensors:
        if not spec.name or spec.name in names:
            raise WeightError(f"tensor name {spec.name!r} is empty or repeated")
        names.add(spec.name)
        dtype = getattr(torch, spec.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise WeightError(f"tensor {spec.name}: unknown dtype {spec.dtype!r}")
        if any(d < 0 for d in spec.shape):
            raise WeightError(f"tensor {spec.name}: negative dimension in {list(spec.shape)}")
        expected = int(np.prod(spec.shape, dtype=np.int64)) * dtype.itemsize
        if spec.nbytes != expected:
            raise WeightError(f"tensor {spec.name}: nbytes {spec.nbytes} != {expected} for its shape and dtype")
        if len(spec.checksum) != 32:
            raise WeightError(f"tensor {spec.name}: checksum must be 32 bytes")
        total += spec.nbytes
    if total > max_total_bytes:
        raise WeightError(f"version holds {total} bytes > limit {max_total_bytes}")


def iter_chunks(index: int, data: bytes | memoryview, chunk_bytes: int) -> Iterator[pb.TensorChunk]:
    view = memoryview(data)
    for offset in range(0, len(view), chunk_bytes):
        yield pb.TensorChunk(tensor_index=index, offset=offset, data=bytes(view[offset : offset + chunk_bytes]))


# A Pull chunk travels as a PullResponse{chunk: TensorChunk} built by hand: valid protobuf (any
# generated client decodes it), but made with a single copy of the data and parsed into a view
# of the received buffer instead of two more copies through the protobuf runtime.


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise IndexError("truncated varint")
        byte = buf[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        if not byte & 0x80:
            return value, pos
        shift += 7


def encode_chunk_frame(index: int, offset: int, data: bytes | memoryview) -> bytes:
    """The serialised PullResponse{chunk: TensorChunk(index, offset, data)}."""
    head = b"\x08" + _varint(index) + b"\x10" + _varint(offset) + b"\x1a" + _varint(len(data))
    return b"".join((b"\x12", _varint(len(head) + len(data)), head, data))


def parse_pull_frame(raw: bytes) -> pb.PullHeader | tuple[int, int, memoryview]:
    """A serialised PullResponse → its header, or (tensor_index, offset, data view) of its chunk.

    Frames made by `encode_chunk_frame` take the fast path; anything else goes through protobuf.
    """
    try:
        if raw[:1] == b"\x12":
            size, pos = _read_varint(raw, 1)
            if pos + size == len(raw):
                fields: dict[int, int | memoryview] = {}
                while pos < len(raw):
                    tag, pos = _read_varint(raw, pos)
                    if tag in (0x08, 0x10):
                        fields[tag >> 3], pos = _read_varint(raw, pos)
                    elif tag == 0x1A:
                        length, pos = _read_varint(raw, pos)
                        if pos + length > len(raw):
                            break
                        fields[3], pos = memoryview(raw)[pos : pos + length], pos + length
                    else:
                        break
                else:
                    return int(fields.get(1, 0)), int(fields.get(2, 0)), fields.get(3, memoryview(b""))
    except IndexError:
        pass
    try:
        message = pb.PullResponse.FromString(raw)
    except Exception as exc:  # noqa: BLE001 - protobuf raises DecodeError subclasses per runtime
        raise WeightError(f"undecodable pull frame: {exc}") from None
    if message.HasField("header"):
        return message.header
    if message.HasField("chunk"):
        return message.chunk.tensor_index, message.chunk.offset, memoryview(message.chunk.data)
    raise WeightError("empty pull frame")


class Assembler:
    """Collects chunks (in any order) into one buffer per tensor.

    `add` rejects chunks out of range or repeated; `finish()` checks that each tensor's chunks
    tile it exactly. `complete(i)` says when tensor i has received all its bytes.
    """

    def __init__(self, sizes: list[int]) -> None:
        self.buffers = [bytearray(n) for n in sizes]
        self.received = [0] * len(sizes)
        self.spans: list[dict[int, int]] = [{} for _ in sizes]

    def add(self, index: int, offset: int, data: bytes | memoryview) -> int:
        if index >= len(self.buffers):
            raise WeightError(f"chunk for tensor {index}, manifest has {len(self.buffers)}")
        buffer, end = self.buffers[index], offset + len(data)
        if end > len(buffer):
            raise WeightError(f"tensor {index}: chunk ends at {end} past its {len(buffer)} bytes")
        if offset in self.spans[index]:
            raise WeightError(f"tensor {index}: chunk at offset {offset} received twice")
        buffer[offset:end] = data
        self.spans[index][offset] = end
        self.received[index] += len(data)
        return len(data)

    def complete(self, index: int) -> bool:
        return self.received[index] == len(self.buffers[index])

    def finish(self) -> list[bytearray]:
        for index, buffer in enumerate(self.buffers):
            position = 0
            for offset in sorted(self.spans[index]):
                if offset != position:
                    break
                position = self.spans[index][offset]
            if position != len(buffer) or self.received[index] != len(buffer):
                raise WeightError(f"incomplete: tensor {index} did not receive exactly its {len(buffer)} bytes")
        return self.buffers


def verify_payloads(manifest: pb.WeightManifest, payloads: list[bytearray]) -> None:
    for spec, data in zip(manifest.tensors, payloads, strict=True):
        if digest(data) != spec.checksum:
            raise WeightError(f"tensor {spec.name}: checksum mismatch")


# --- deltas -------------------------------------------------------------------------------------


def encode_delta(
    target: bytes | memoryview, base: bytes | memoryview | None, same_digest: bool
) -> tuple[int, bytes | memoryview]:
    """(encoding, wire bytes) of one tensor against the base version's bytes.

    UNCHANGED when the digests match; XOR_ZSTD (target XOR base, zstd level 1) when it is smaller
    than the raw bytes; FULL otherwise.
    """
    if base is None or len(base) != len(target):
        return pb.FULL, memoryview(target)
    if same_digest:
        return pb.UNCHANGED, b""
    import zstandard

    xored = np.bitwise_xor(np.frombuffer(target, np.uint8), np.frombuffer(base, np.uint8))
    packed = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(xored.tobytes())
    if len(packed) < len(target):
        return pb.XOR_ZSTD, packed
    return pb.FULL, memoryview(target)


def decode_delta(encoding: int, wire: bytes | bytearray, base: bytes | bytearray | None, nbytes: int) -> bytearray:
    """Raw bytes of a tensor from its wire form (inverse of encode_delta)."""
    if encoding == pb.FULL:
        return wire if isinstance(wire, bytearray) else bytearray(wire)
    if base is None or len(base) != nbytes:
        raise WeightError("delta against a base the receiver does not hold")
    if encoding == pb.UNCHANGED:
        return bytearray(base)
    if encoding == pb.XOR_ZSTD:
        import zstandard

        try:
            xored = zstandard.ZstdDecompressor().decompress(bytes(wire), max_output_size=nbytes)
        except zstandard.ZstdError as exc:
            raise WeightError(f"delta does not decompress: {exc}") from None
        if len(xored) != nbytes:
            raise WeightError(f"delta decompresses to {len(xored)} bytes, expected {nbytes}")
        return bytearray(np.bitwise_xor(np.frombuffer(xored, np.uint8), np.frombuffer(base, np.uint8)).tobytes())
    raise WeightError(f"unknown tensor encoding {encoding}")
