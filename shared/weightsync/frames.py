"""The gRPC wire format of a weight version: chunks of each tensor's bytes, the Pull stream's frames
written and parsed by hand, their reassembly, and deltas against a version the receiver holds."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from shared.rpc.steadyrl.v1 import weightsync_pb2 as pb
from shared.weightsync.base import WeightError

ZSTD_LEVEL = 1


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
        low = value & 0x7F
        value = value >> 7
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
                        fields[3] = memoryview(raw)[pos : pos + length]
                        pos = pos + length
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
        buffer = self.buffers[index]
        end = offset + len(data)
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
