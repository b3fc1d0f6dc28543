"""Pure weight-wire helpers: chunk frames, the assembler, deltas."""

import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.rpc.steadyrl.v1 import weightsync_pb2 as pb
from shared.weightsync.frames import (
    Assembler,
    decode_delta,
    encode_chunk_frame,
    encode_delta,
    parse_pull_frame,
)
from shared.weightsync.manifest import WeightError


@given(st.integers(0, 2**32 - 1), st.integers(0, 2**63), st.binary(max_size=300))
def test_chunk_frame_is_the_protobuf_encoding(index, offset, data):
    frame = encode_chunk_frame(index, offset, memoryview(data))
    message = pb.PullResponse.FromString(frame)
    assert (message.chunk.tensor_index, message.chunk.offset, message.chunk.data) == (index, offset, data)
    got_index, got_offset, view = parse_pull_frame(frame)
    assert (got_index, got_offset, bytes(view)) == (index, offset, data)
    # what the protobuf runtime serialises (zero fields omitted) parses the same way
    canonical = pb.PullResponse(chunk=pb.TensorChunk(tensor_index=index, offset=offset, data=data))
    parsed = parse_pull_frame(canonical.SerializeToString())
    assert (parsed[0], parsed[1], bytes(parsed[2])) == (index, offset, data)


def test_pull_frame_header_and_garbage():
    header = pb.PullHeader(base_version=3, encoded_nbytes=[5])
    assert parse_pull_frame(pb.PullResponse(header=header).SerializeToString()) == header
    with pytest.raises(WeightError, match="undecodable"):
        parse_pull_frame(b"\x12\x05\x1a\xff\xff")  # declared length runs past the end
    with pytest.raises(WeightError, match="empty"):
        parse_pull_frame(b"")


def test_assembler_accepts_any_order_and_rejects_repeats_gaps_and_overruns():
    data = os.urandom(10)
    a = Assembler([10])
    assert a.add(0, 6, data[6:]) == 4 and not a.complete(0)
    a.add(0, 0, data[:6])
    assert a.complete(0) and a.finish() == [bytearray(data)]
    b = Assembler([10])
    b.add(0, 0, data[:6])
    with pytest.raises(WeightError, match="twice"):
        b.add(0, 0, data[:6])
    with pytest.raises(WeightError, match="past"):
        b.add(0, 8, data[:6])
    with pytest.raises(WeightError, match="manifest has 1"):
        b.add(1, 0, data)
    b.add(0, 5, data[5:])  # overlaps byte 5: the counts add up to 11, the tiling does not fit
    with pytest.raises(WeightError, match="exactly"):
        b.finish()
    with pytest.raises(WeightError, match="exactly"):
        Assembler([4]).finish()


def test_delta_round_trip_and_encodings():
    base = bytearray(os.urandom(4096))
    target = bytearray(base)
    target[100] ^= 0xFF
    enc, wire = encode_delta(memoryview(target), memoryview(base), False)
    assert enc == pb.XOR_ZSTD and len(wire) < 200
    assert decode_delta(enc, wire, base, len(target)) == target
    assert encode_delta(target, base, True) == (pb.UNCHANGED, b"")
    random = bytearray(os.urandom(4096))
    enc, wire = encode_delta(random, base, False)
    assert enc == pb.FULL and bytes(wire) == bytes(random)
    with pytest.raises(WeightError, match="not hold"):
        decode_delta(pb.XOR_ZSTD, b"", None, 4096)


def test_shm_pruning_keeps_the_newest_up_to_the_version_just_written_and_drops_an_earlier_runs(tmp_path):
    from shared.weightsync.shm import prune_shm

    for version in [1, 2, 3, 4, 5, 40, 41]:  # v40, v41: left by a killed run of the same run id
        (tmp_path / f"v{version}.safetensors").write_bytes(bytes([version]))
    spare = prune_shm(tmp_path, keep=2, current=5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v3.safetensors", "v4.safetensors", "v5.safetensors"]
    assert spare == tmp_path / "v3.safetensors"  # the newest old one, to be written over
    assert prune_shm(tmp_path, keep=0, current=5) == tmp_path / "v5.safetensors"
    assert [p.name for p in tmp_path.iterdir()] == ["v5.safetensors"]


def test_a_version_file_gone_empty_cut_short_or_foreign_is_a_weight_error(tmp_path):
    from shared.weightsync.shm import map_version

    with pytest.raises(WeightError, match="v1.safetensors: .*No such file"):
        map_version(tmp_path / "v1.safetensors")  # pruned between its announcement and the read
    for name, data in [
        ("empty", b""),
        ("short", b"\x01"),
        ("long", (1 << 40).to_bytes(8, "little") + b"{}"),
        ("text", (2).to_bytes(8, "little") + b"\xff\xfe"),
        ("list", (2).to_bytes(8, "little") + b"[]"),
    ]:
        (tmp_path / name).write_bytes(data)
        with pytest.raises(WeightError, match=f"version file {name}: "):
            map_version(tmp_path / name)


def test_the_transports_are_named_in_the_registry_alone():
    """No module branches on a transport's name: each is declared once, in `base.TRANSPORTS`, and
    looked up there."""
    import re

    from shared.weightsync.base import TRANSPORTS, TransportName, transport

    root = Path(__file__).resolve().parents[2]
    quoted = re.compile(r"""["'](?:shm|collective)["']""")
    found = [
        f"{p.relative_to(root)}:{n}"
        for base in ("shared", "services")
        for p in sorted((root / base).rglob("*.py"))
        if "rpc/steadyrl" not in str(p) and p != root / "shared" / "weightsync" / "base.py"
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if quoted.search(line)
    ]
    assert found == []
    assert {transport(name).name for name in TRANSPORTS} == set(TransportName)


def test_a_pull_is_bounded_by_the_size_of_its_version():
    from shared.weightsync.grpc import GrpcDelivery, pull_deadline

    manifest = pb.WeightManifest(
        version=3, tensors=[pb.TensorSpec(name="a", nbytes=100_000_000), pb.TensorSpec(name="b", nbytes=50_000_000)]
    )
    assert pull_deadline(manifest) == 30.0 + 3.0  # 150 MB at the 50 MB/s floor
    assert pull_deadline(None) == pull_deadline(pb.WeightManifest(version=3)) == 600.0  # size unknown
    assert GrpcDelivery("127.0.0.1:1", 3, manifest).timeout == 33.0
    assert GrpcDelivery("127.0.0.1:1", 3, manifest, timeout=5.0).timeout == 5.0


def test_the_weight_dtypes_a_manifest_may_name_are_torch_s_with_torch_s_sizes_and_spill_to_safetensors():
    import torch
    from safetensors.torch import _TYPES as SAFETENSORS_TYPES

    from shared.weightsync.base import WEIGHT_DTYPES

    for name, (size, code) in WEIGHT_DTYPES.items():
        dtype = getattr(torch, name)
        assert isinstance(dtype, torch.dtype) and str(dtype) == f"torch.{name}" and dtype.itemsize == size
        assert SAFETENSORS_TYPES[code] == dtype  # the file a version spills to and is mapped from holds it
    # what a trainer publishes (fp32, bf16, fp16) and a model's integer buffers are among them
    assert {"float32", "bfloat16", "float16", "int64", "bool", "uint8"} <= set(WEIGHT_DTYPES)


def _manifest(dtype: str, shape: list[int], nbytes: int) -> pb.WeightManifest:
    manifest = pb.WeightManifest(version=1, checksum_algo="blake3")
    manifest.tensors.add(name="w", dtype=dtype, shape=shape, nbytes=nbytes, checksum=bytes(32))
    return manifest


def test_a_manifest_naming_a_dtype_outside_them_is_refused_before_any_byte():
    from shared.weightsync.manifest import bytes_to_tensor, validate_manifest

    for dtype in ("half", "qint8", "uint16", "float8_e4m3fn", "", "float32\x00"):  # an alias, unspillable, odd
        with pytest.raises(WeightError, match="unknown dtype"):
            validate_manifest(_manifest(dtype, [2], 4), 1 << 20)
    validate_manifest(_manifest("float16", [2], 4), 1 << 20)
    with pytest.raises(WeightError, match="unknown dtype 'qint8'"):
        bytes_to_tensor(b"\0\0", "qint8", [2])
    with pytest.raises(WeightError) as refused:  # a long dtype is named cut: the refusal fits a gRPC status
        validate_manifest(_manifest("x" * 100_000, [2], 4), 1 << 20)
    assert len(str(refused.value)) < 100


def test_a_shape_whose_bytes_overflow_int64_is_refused_not_wrapped():
    from shared.weightsync.manifest import validate_manifest

    # these products wrap to 0, 4 and a negative count in int64: a forged nbytes matched them
    for shape, nbytes in (([2**31, 2**31, 4], 0), ([2**63 - 1, 2**63 - 1], 4), ([2**60, 8], 0)):
        with pytest.raises(WeightError, match=r"nbytes \d+ != more than 1048576"):
            validate_manifest(_manifest("float32", shape, nbytes), 1 << 20)
    with pytest.raises(WeightError, match="more than 1048576 bytes"):  # exact, and past the limit
        validate_manifest(_manifest("uint8", [2**20 + 1], 2**20 + 1), 1 << 20)
