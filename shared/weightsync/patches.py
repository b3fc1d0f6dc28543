"""A version as a patch: only the elements that changed since the version a receiver holds, as the zstd of the
gaps between their flat indices (a byte each below 255) and the zstd of their new bits XOR their old ones. The
publisher (`PatchEncoder`) keeps the last version it published and decides per tensor (a patch when it is at most
`MAX_SHARE` of the bytes) and per version (whole when the patched version would still be more than `MAX_SHARE` of
it); a receiver applies one only to the exact bytes of `WeightManifest.patch_base`.

Details (the form's measurement, who applies what): docs/internals/weights.md"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import blake3
import numpy as np
from prometheus_client import Counter

from shared.rpc.steadyrl.v1 import weightsync_pb2 as pb
from shared.weightsync.base import WEIGHT_DTYPES, WeightError

if TYPE_CHECKING:
    import torch

MAX_SHARE = 0.5  # a tensor is patched when its patch is at most this share of its bytes
DENSE_REST = 16  # a tensor found too changed to patch goes whole, uncompared, for this many versions
ZSTD_LEVEL = 1
BITS = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}  # an element's bits by its size
WEIGHT_BYTES = Counter(
    "steadyrl_weights_bytes_total",
    "Bytes of the weight versions the trainer published, by how each tensor went: whole (full) or as a patch",
    ["kind"],
)


@dataclass
class Encoded:
    """One tensor of a version as the encoder found it: its full digest, and its patch (None: whole)."""

    digest: bytes
    patch: bytes | None = None
    count: int = 0
    index_nbytes: int = 0


def gap_bytes(indices: np.ndarray, start: int = 0) -> np.ndarray:
    """The gaps between ascending flat indices (the first from `start`) as bytes: a gap g is g // 255
    bytes of 255, then g % 255 (a byte below 255 ends a gap). At a few percent of elements changed a
    gap is mostly one byte: four times less for zstd to read than uint32 gaps, and smaller."""
    gaps = np.diff(indices, prepend=start)
    big = gaps >= 255
    if not big.any():
        return gaps.astype(np.uint8)
    runs = np.zeros(len(gaps), np.int64)
    runs[big] = gaps[big] // 255
    out = np.full(int(runs.sum()) + len(gaps), 255, np.uint8)
    out[np.cumsum(runs + 1) - 1] = (gaps - 255 * runs).astype(np.uint8)
    return out


def compress(gaps: bytes, xor: np.ndarray) -> tuple[bytes, int]:
    """(patch bytes, bytes of its index part) of the changed elements' gap bytes and their bits
    XOR the base's."""
    import zstandard

    compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    index_part = compressor.compress(gaps)
    return index_part + compressor.compress(np.ascontiguousarray(xor).tobytes()), len(index_part)


def encode(indices: np.ndarray, xor: np.ndarray) -> tuple[bytes, int]:
    """(patch bytes, bytes of its index part) of the changed elements' flat `indices` (ascending)
    and their bits XOR the base's."""
    return compress(gap_bytes(indices).tobytes(), xor)


def bounded(data: bytes, most: int, name: str) -> bytes:
    """`data` decompressed (zstd), read a MiB at a time and refused once past `most` bytes, whatever its
    frame header claims: a small patch that expands to gigabytes costs at most `most` + 1 MiB."""
    import io

    import zstandard

    out = bytearray()
    try:
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data)) as reader:
            while len(out) <= most:
                piece = reader.read(min(most + 1 - len(out), 1 << 20))
                if not piece:
                    break
                out += piece
    except zstandard.ZstdError as exc:
        raise WeightError(f"tensor {name}: its patch does not decompress: {exc}") from None
    if len(out) > most:
        raise WeightError(f"tensor {name}: its patch decompresses past the {most} bytes its entry allows")
    return bytes(out)


def decode(blob: bytes | memoryview | np.ndarray, spec: pb.TensorSpec) -> tuple[np.ndarray, np.ndarray]:
    """(flat indices int64, bits to XOR in) of a tensor's patch, checked against its manifest entry
    (WeightError: a patch that does not decode to `count` ascending indices inside the tensor)."""
    patch, itemsize = spec.patch, WEIGHT_DTYPES[spec.dtype][0]
    numel = spec.nbytes // itemsize
    raw = bytes(blob)
    if len(raw) != patch.nbytes or patch.index_nbytes > patch.nbytes or patch.count > numel:
        raise WeightError(f"tensor {spec.name}: a patch of {len(raw)} bytes does not match its entry")
    most = patch.count + numel // 255 + 1  # the gaps' bytes: one per element, one per 255 of the tensor
    gaps = bounded(raw[: patch.index_nbytes], most, spec.name)
    bits = bounded(raw[patch.index_nbytes :], itemsize * patch.count, spec.name)
    steps = np.frombuffer(gaps, np.uint8)
    ends = steps != 255
    if len(bits) != itemsize * patch.count or int(ends.sum()) != patch.count or (len(steps) and not ends[-1]):
        raise WeightError(f"tensor {spec.name}: its patch does not hold {patch.count} elements")
    indices = np.cumsum(steps, dtype=np.int64)[ends]
    if patch.count and ((np.diff(indices) <= 0).any() or indices[-1] >= numel):
        raise WeightError(f"tensor {spec.name}: its patch's indices repeat or fall outside it")
    return indices, np.frombuffer(bits, BITS[itemsize])


def apply(target: torch.Tensor, blob, spec: pb.TensorSpec) -> None:
    """Write a patch into `target` in place: the tensor of the base version (contiguous, the
    manifest's dtype and shape) becomes this version's, bit for bit."""
    import torch

    indices, bits = decode(blob, spec)
    if str(target.dtype).removeprefix("torch.") != spec.dtype or list(target.shape) != list(spec.shape):
        raise WeightError(f"tensor {spec.name}: a patch applies to the manifest's dtype and shape only")
    if not target.is_contiguous():
        raise WeightError(f"tensor {spec.name}: a patch applies to a contiguous tensor only")
    flat = target.view(getattr(torch, np.dtype(bits.dtype).name)).reshape(-1)
    at = torch.from_numpy(indices).to(target.device)
    flat[at] = flat[at] ^ torch.from_numpy(bits.copy()).to(target.device)


def apply_in_place(buffer: bytearray | np.ndarray, blob, spec: pb.TensorSpec) -> None:
    """Write a patch into a writable buffer holding the base version's raw bytes of the tensor."""
    indices, bits = decode(blob, spec)
    if len(buffer) != spec.nbytes:
        raise WeightError(f"tensor {spec.name}: its base holds {len(buffer)} bytes, not {spec.nbytes}")
    np.frombuffer(buffer, dtype=bits.dtype)[indices] ^= bits


def apply_bytes(base: bytearray | memoryview, blob, spec: pb.TensorSpec) -> bytearray:
    """A new buffer: the base version's raw bytes of a tensor with its patch applied."""
    out = bytearray(base)
    apply_in_place(out, blob, spec)
    return out


def base_by_name(manifest: pb.WeightManifest, payloads) -> dict[str, tuple[pb.TensorSpec, bytes]]:
    """A version's tensors as `made_whole` reads its base: name → (entry, raw bytes)."""
    return {spec.name: (spec, data) for spec, data in zip(manifest.tensors, payloads, strict=True)}


def made_whole(spec: pb.TensorSpec, item, base: Mapping[str, tuple[pb.TensorSpec, bytes]]) -> bytearray:
    """A tensor of a patch version as weight-sync keeps it: its patch applied to the base version's
    bytes of the same tensor (name, dtype, shape; `base`: name → (entry, bytes)) and checked against
    the full digest, or its own bytes (checked already where they were read)."""
    from shared.weightsync.manifest import digest, tensor_to_bytes

    if not isinstance(item, Patch):
        return bytearray(tensor_to_bytes(item))
    old = base.get(spec.name)
    if old is None or (old[0].dtype, list(old[0].shape)) != (spec.dtype, list(spec.shape)):
        raise WeightError(f"tensor {spec.name}: its base version holds no tensor of this name, dtype and shape")
    data = apply_bytes(old[1], item.blob, spec)
    if digest(data) != spec.checksum:
        raise WeightError(f"tensor {spec.name}: made whole, its bytes are not the manifest's")
    return data


@dataclass
class Patch:
    """A patched tensor in a delivery's bucket: its manifest entry and its patch's bytes."""

    spec: pb.TensorSpec
    blob: memoryview | np.ndarray

    @property
    def nbytes(self) -> int:
        return len(self.blob)

    def apply_to(self, target: torch.Tensor) -> None:
        apply(target, self.blob, self.spec)


@dataclass
class PatchEncoder:
    """The publisher's copy of the last version it published (`held`: each tensor's bytes in the
    published dtype, `version` its number) and, for each new version, what changed since."""

    max_share: float = MAX_SHARE
    held: dict[str, np.ndarray] = field(default_factory=dict)
    layout: dict[str, tuple[str, list[int]]] = field(default_factory=dict)
    version: int = 0
    resting: dict[str, int] = field(default_factory=dict)  # tensors going whole uncompared: versions left

    def reset(self) -> None:
        """Forget the version held: the next is published whole (a failed publish, a lost base)."""
        self.held, self.layout, self.version, self.resting = {}, {}, 0, {}

    def base_for(self, layout: Mapping[str, tuple[str, list[int]]]) -> int:
        """The version a new one of `layout` (name → (dtype, shape)) can be patched against, 0: none."""
        return self.version if self.version and dict(layout) == self.layout else 0

    def update(self, name: str, meta: tuple[str, list[int]], pieces: Iterator[memoryview], patch: bool) -> Encoded:
        """Read a tensor's new bytes piece by piece: hash them, keep them, and (`patch`) find the
        elements that differ from the bytes held, giving up once more than half of them do."""
        dtype, shape = meta
        itemsize = WEIGHT_DTYPES[dtype][0]
        nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize
        held = self.held.get(name)
        if held is None or len(held) != nbytes:
            held = self.held[name] = np.empty(nbytes, np.uint8)
            patch = False
        self.layout[name] = (dtype, list(shape))
        patch = patch and nbytes > 0
        if patch and self.resting.get(name, 0) > 0:  # found dense lately: whole, at the cost of a whole one
            self.resting[name] -= 1
            patch = False
        tried = patch
        hasher = blake3.blake3(max_threads=blake3.blake3.AUTO if nbytes >= 1 << 22 else 1)
        kind = BITS[itemsize]
        gaps, xors, count, at, last = [], [], 0, 0, 0
        for piece in pieces:  # a piece at a time, in cache: compared, its changes taken, kept, hashed
            new = np.frombuffer(piece, np.uint8)
            hasher.update(piece)
            old = held[at : at + len(new)]
            if patch:
                fresh, stale = new.view(kind), old.view(kind)
                changed = np.flatnonzero(fresh != stale)
                count += len(changed)
                if count * 2 > nbytes // itemsize:
                    patch = False  # more than half changed: whole
                elif len(changed):
                    changed += at // itemsize
                    gaps.append(gap_bytes(changed, last))
                    xors.append(fresh[changed - at // itemsize] ^ stale[changed - at // itemsize])
                    last = int(changed[-1])
            old[:] = new
            at += len(new)
        encoded = Encoded(hasher.digest())
        if patch:
            blob, index_nbytes = compress(
                b"".join(g.tobytes() for g in gaps), np.concatenate(xors) if xors else np.empty(0, kind)
            )
            if len(blob) <= self.max_share * nbytes:
                encoded.patch, encoded.count, encoded.index_nbytes = blob, count, index_nbytes
        if tried and encoded.patch is None:
            self.resting[name] = DENSE_REST
        return encoded

    def tensor(self, name: str) -> torch.Tensor:
        """The bytes held of `name` as its tensor (a view: valid until the next version)."""
        import torch

        dtype, shape = self.layout[name]
        return torch.from_numpy(self.held[name]).view(getattr(torch, dtype)).reshape(shape)

    def forget_others(self, names: set[str]) -> None:
        """Drop what is held of tensors the last version did not have."""
        for name in set(self.held) - names:
            del self.held[name]
            self.layout.pop(name, None)


def spec_of(name: str, meta: tuple[str, list[int]], encoded: Encoded) -> pb.TensorSpec:
    """The manifest entry of a tensor the encoder read: its full digest, and its patch's when it has one."""
    dtype, shape = meta
    nbytes = int(np.prod(shape, dtype=np.int64)) * WEIGHT_DTYPES[dtype][0]
    spec = pb.TensorSpec(name=name, dtype=dtype, shape=shape, nbytes=nbytes, checksum=encoded.digest)
    if encoded.patch is not None:
        from shared.weightsync.manifest import digest

        spec.patch.CopyFrom(
            pb.TensorPatch(
                count=encoded.count,
                index_nbytes=encoded.index_nbytes,
                nbytes=len(encoded.patch),
                checksum=digest(encoded.patch),
            )
        )
    return spec


def wire_nbytes(spec: pb.TensorSpec) -> int:
    """Bytes a tensor's entry takes in a broadcast bucket: its own, or its patch's rounded up to 8
    (what follows a patch stays aligned for its dtype)."""
    return -(-spec.patch.nbytes // 8) * 8 if spec.HasField("patch") else spec.nbytes


def patch_manifest(
    tensors: Mapping[str, torch.Tensor], version: int, parent_version: int, base: int, specs, signer
) -> pb.WeightManifest:
    """The (signed) manifest of a version `encode_version` read: its entries and their patches' base."""
    from shared.weightsync.manifest import empty_manifest

    manifest = empty_manifest(tensors, version, parent_version)
    manifest.patch_base = base
    manifest.tensors.extend(specs)
    return signer.sign(manifest) if signer is not None else manifest


def patched_bytes(manifest: pb.WeightManifest) -> tuple[int, int]:
    """(bytes sent whole, bytes sent as patches) of a version as its transport carries it."""
    return patched_bytes_of(manifest.tensors)


def patched_bytes_of(specs) -> tuple[int, int]:
    """(bytes sent whole, bytes sent as patches) of these manifest entries."""
    whole = sum(spec.nbytes for spec in specs if not spec.HasField("patch"))
    return whole, sum(spec.patch.nbytes for spec in specs if spec.HasField("patch"))


def as_whole(manifest: pb.WeightManifest) -> pb.WeightManifest:
    """A copy of `manifest` describing its version's bytes whole (a patch version made whole, as
    a file holds it): no patches, no base."""
    whole = pb.WeightManifest()
    whole.CopyFrom(manifest)
    whole.patch_base = 0
    for spec in whole.tensors:
        spec.ClearField("patch")
    return whole


def count_bytes(manifest: pb.WeightManifest) -> None:
    """A published version's bytes into `steadyrl_weights_bytes_total{kind}`."""
    whole, patched = patched_bytes(manifest)
    WEIGHT_BYTES.labels("full").inc(whole)
    WEIGHT_BYTES.labels("patch").inc(patched)


def encode_version(
    tensors: Mapping[str, torch.Tensor], encoder: PatchEncoder
) -> tuple[int, list[pb.TensorSpec], dict[str, torch.Tensor]]:
    """A version read once through `encoder`: (the version its patches apply to, 0 when none is; each
    tensor's manifest entry; what the transport carries of each: its patch's bytes as a uint8
    tensor, or the tensor whole, from the encoder's copy). A whole version when the encoder holds
    none of this layout, or for an adapter (not patched)."""
    import torch

    from shared.weightsync.manifest import PIECE_BYTES, pieces, tensor_meta

    layout = {name: tensor_meta(tensors, name) for name in tensors}
    base = 0 if getattr(tensors, "adapter", None) is not None else encoder.base_for(layout)
    scratch = torch.empty(PIECE_BYTES, dtype=torch.uint8)
    specs, payloads = [], {}
    for name, meta in layout.items():
        encoded = encoder.update(name, meta, pieces(tensors, name, scratch), patch=bool(base))
        specs.append(spec_of(name, meta, encoded))
        payloads[name] = (
            torch.frombuffer(bytearray(encoded.patch), dtype=torch.uint8)
            if encoded.patch is not None
            else encoder.tensor(name)
        )
    encoder.forget_others(set(layout))
    whole, patched = patched_bytes_of(specs)
    if patched and whole + patched > encoder.max_share * sum(spec.nbytes for spec in specs):
        # most of the version changed: whole, and every tensor rests (the demo's lr: nothing to gain)
        for spec in specs:
            if spec.HasField("patch"):
                spec.ClearField("patch")
                payloads[spec.name] = encoder.tensor(spec.name)
            encoder.resting[spec.name] = DENSE_REST
    return (base if any(spec.HasField("patch") for spec in specs) else 0), specs, payloads
