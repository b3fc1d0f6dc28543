"""A version as a patch (shared/weightsync/patches.py): what changed is found bit for bit, the patch
applied to the base's bytes gives the new ones exactly, and a malformed patch or entry is refused."""

import numpy as np
import pytest
import torch

from shared.rpc.steadyrl.v1 import weightsync_pb2 as pb
from shared.weightsync.base import WeightError
from shared.weightsync.manifest import CastView, digest, tensor_to_bytes, validate_manifest
from shared.weightsync.patches import PatchEncoder, apply, apply_bytes, decode, encode_version, patched_bytes


def changed_copy(tensor: torch.Tensor, share: float, seed: int) -> torch.Tensor:
    """`tensor` with `share` of its elements changed, among them bit patterns a float compare misses."""
    gen = torch.Generator().manual_seed(seed)
    out = tensor.clone()
    flat = out.reshape(-1)
    picked = torch.randperm(flat.numel(), generator=gen)[: int(share * flat.numel())]
    if tensor.is_floating_point():
        flat[picked] = flat[picked] * 1.5 + 0.25
        bits = flat.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])
        bits[picked[:3]] ^= 1 << (8 * flat.element_size() - 1)  # a sign flip: 0.0 → -0.0 where zero
        flat[picked[3:4]] = float("nan")
    else:
        flat[picked] = flat[picked] + 1
    return out


def encoded(versions: list[dict[str, torch.Tensor]]) -> list[tuple[int, list[pb.TensorSpec], dict]]:
    encoder = PatchEncoder()
    out = []
    for number, tensors in enumerate(versions, start=1):
        base, specs, payloads = encode_version(tensors, encoder)
        encoder.version = number
        out.append((base, specs, {k: v.clone() for k, v in payloads.items()}))
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int64])
def test_a_patch_applied_to_the_base_gives_the_new_bytes_exactly(dtype):
    gen = torch.Generator().manual_seed(0)
    first = {"w": (torch.randn(300, 70, generator=gen) * 0.02).to(dtype), "zeros": torch.zeros(64, dtype=dtype)}
    first["zeros"][:10] = 0  # +0.0 elements whose sign flips are a change
    second = {name: changed_copy(t, 0.03, 1) for name, t in first.items()}
    (base0, specs0, _), (base1, specs1, payloads1) = encoded([first, second])
    assert base0 == 0 and not any(s.HasField("patch") for s in specs0)  # the first version goes whole
    assert base1 == 1
    spec = specs1[0]
    assert spec.HasField("patch") and spec.patch.count == int(0.03 * 300 * 70)
    assert spec.checksum == digest(tensor_to_bytes(second["w"]))  # the full version's digest
    assert spec.patch.checksum == digest(tensor_to_bytes(payloads1["w"]))  # and the patch's own
    assert spec.patch.nbytes <= 0.5 * spec.nbytes
    target = first["w"].clone()
    apply(target, tensor_to_bytes(payloads1["w"]), spec)
    assert torch.equal(target.view(torch.uint8), second["w"].view(torch.uint8))  # bit for bit, NaN and -0.0 too
    rebuilt = apply_bytes(bytearray(tensor_to_bytes(first["w"])), tensor_to_bytes(payloads1["w"]), spec)
    assert bytes(rebuilt) == bytes(tensor_to_bytes(second["w"]))


def test_a_tensor_that_changes_densely_goes_whole_and_an_unchanged_one_as_an_empty_patch():
    gen = torch.Generator().manual_seed(0)
    first = {"dense": torch.randn(4096, generator=gen), "same": torch.randn(3 * 4096, generator=gen)}
    second = {"dense": first["dense"] * 1.001 + 1e-3, "same": first["same"].clone()}
    _, (_, specs, payloads) = encoded([first, second])
    dense, same = specs
    assert not dense.HasField("patch") and torch.equal(payloads["dense"], second["dense"])
    assert same.HasField("patch") and same.patch.count == 0 and same.patch.nbytes < 64
    target = first["same"].clone()
    apply(target, tensor_to_bytes(payloads["same"]), same)
    assert torch.equal(target, second["same"])


def test_a_new_layout_or_an_adapter_is_published_whole():
    first = {"w": torch.zeros(8, 8)}
    reshaped = {"w": torch.zeros(4, 16)}
    renamed = {"v": torch.zeros(8, 8)}
    assert [base for base, _, _ in encoded([first, reshaped])] == [0, 0]
    assert [base for base, _, _ in encoded([first, renamed])] == [0, 0]
    encoder = PatchEncoder()
    encode_version(CastView(first, torch.bfloat16), encoder)
    encoder.version = 1
    adapter = CastView(first, torch.bfloat16, adapter=pb.AdapterInfo(base_digest=b"x" * 32, config_json="{}"))
    assert encode_version(adapter, encoder)[0] == 0


def test_a_cast_view_is_patched_as_published_in_bf16():
    """The trainer's fp32 master at a small learning rate: most bf16 elements stay the same."""
    gen = torch.Generator().manual_seed(0)
    master = {"w": torch.randn(1000, 100, generator=gen) * 0.02}
    stepped = {"w": master["w"] + 1e-6 * torch.randn(1000, 100, generator=gen).sign()}
    _, (base, specs, payloads) = encoded([CastView(master, torch.bfloat16), CastView(stepped, torch.bfloat16)])
    spec = specs[0]
    before, after = master["w"].to(torch.bfloat16), stepped["w"].to(torch.bfloat16)
    changed = int((before.view(torch.int16) != after.view(torch.int16)).sum())
    assert base == 1 and spec.dtype == "bfloat16" and spec.patch.count == changed
    assert 0 < changed < 0.1 * before.numel()
    whole, patched = patched_bytes(pb.WeightManifest(tensors=specs))
    assert whole == 0 and patched == spec.patch.nbytes < 0.2 * spec.nbytes
    apply(before, tensor_to_bytes(payloads["w"]), spec)
    assert torch.equal(before.view(torch.int16), after.view(torch.int16))


def spec_with_patch(blob: bytes, count: int, index_nbytes: int, numel: int = 100) -> pb.TensorSpec:
    return pb.TensorSpec(
        name="w",
        dtype="float32",
        shape=[numel],
        nbytes=4 * numel,
        checksum=b"\0" * 32,
        patch=pb.TensorPatch(count=count, index_nbytes=index_nbytes, nbytes=len(blob), checksum=digest(blob)),
    )


def test_a_malformed_patch_is_refused_before_any_byte_is_written():
    from shared.weightsync.patches import encode

    good, index_nbytes = encode(np.array([3, 7, 9]), np.array([1, 2, 3], np.int32))
    decode(good, spec_with_patch(good, 3, index_nbytes))  # the well-formed one decodes
    repeated, rn = encode(np.array([3, 3, 9]), np.array([1, 2, 3], np.int32))
    outside, on = encode(np.array([3, 7, 100]), np.array([1, 2, 3], np.int32))
    cases = {
        "cut short": (good[:-2], spec_with_patch(good[:-2], 3, index_nbytes)),
        "a count it does not hold": (good, spec_with_patch(good, 4, index_nbytes)),
        "a split past its end": (good, spec_with_patch(good, 3, len(good) + 1)),
        "repeated indices": (repeated, spec_with_patch(repeated, 3, rn)),
        "an index outside the tensor": (outside, spec_with_patch(outside, 3, on)),
        "not zstd": (b"\x01" * 40, spec_with_patch(b"\x01" * 40, 3, 20)),
        "more elements than the tensor": (good, spec_with_patch(good, 101, index_nbytes)),
    }
    target = torch.zeros(100)
    for what, (blob, spec) in cases.items():
        with pytest.raises(WeightError):
            apply(target, blob, spec)
        assert torch.equal(target, torch.zeros(100)), what  # nothing written
    with pytest.raises(WeightError, match="dtype and shape"):
        apply(torch.zeros(100, dtype=torch.float64), good, spec_with_patch(good, 3, index_nbytes))


def test_the_manifest_refuses_a_patch_entry_that_cannot_be_one():
    blob = b"x" * 10

    def manifest(**fields) -> pb.WeightManifest:
        spec = spec_with_patch(blob, 3, 4)
        for name, value in fields.items():
            setattr(spec.patch, name, value)
        m = pb.WeightManifest(version=5, patch_base=fields.pop("_base", 4), checksum_algo="blake3")
        m.tensors.append(spec)
        return m

    validate_manifest(manifest(), 1 << 20)
    for fields, message in [
        ({"count": 101}, "larger than the tensor"),
        ({"nbytes": 401}, "larger than the tensor"),
        ({"index_nbytes": 11}, "larger than the tensor"),
        ({"checksum": b"short"}, "32 bytes"),
    ]:
        with pytest.raises(WeightError, match=message):
            validate_manifest(manifest(**fields), 1 << 20)
    for base in (0, 5, 6):
        m = manifest()
        m.patch_base = base
        with pytest.raises(WeightError, match="patch_base"):
            validate_manifest(m, 1 << 20)
    adapter = manifest()
    adapter.adapter.CopyFrom(pb.AdapterInfo(base_digest=b"x" * 32, config_json='{"r": 1}'))
    with pytest.raises(WeightError, match="adapter"):
        validate_manifest(adapter, 1 << 20)


def test_the_signature_covers_each_patch_and_a_tampered_patch_file_is_refused(tmp_path):
    from shared.weightsync.shm import map_version, read_shm, write_shm
    from shared.weightsync.signing import Signer, Verifier, write_key_pair

    private, public = write_key_pair(tmp_path / "keys")
    gen = torch.Generator().manual_seed(0)
    first = {"w": torch.randn(2000, generator=gen).to(torch.bfloat16)}
    second = {"w": changed_copy(first["w"], 0.02, 1)}
    _, (base, specs, payloads) = encoded([first, second])
    manifest = pb.WeightManifest(version=2, patch_base=base, checksum_algo="blake3")
    manifest.tensors.extend(specs)
    signed = Signer.from_file(private).sign(manifest)
    Verifier.from_file(public).check(signed)
    for field, value in (("checksum", b"\1" * 32), ("count", specs[0].patch.count + 1)):
        forged = pb.WeightManifest()
        forged.CopyFrom(signed)
        setattr(forged.tensors[0].patch, field, value)
        with pytest.raises(WeightError):
            Verifier.from_file(public).check(forged)
    path = tmp_path / "shm" / "v2.safetensors"
    write_shm(path, payloads, 2, 1, digests=False)
    held = read_shm(path, signed)["w"]  # the patch, checked against its signed digest
    target = first["w"].clone()
    held.apply_to(target)
    assert torch.equal(target.view(torch.int16), second["w"].view(torch.int16))
    _, header, start = map_version(path)
    raw = bytearray(path.read_bytes())
    raw[start + header["w"]["data_offsets"][1] - 3] ^= 0x40  # one bit of the patch, after it was written and signed
    path.write_bytes(bytes(raw))
    with pytest.raises(WeightError, match="checksum mismatch"):
        read_shm(path, signed)


def test_gaps_of_any_length_round_trip_through_their_bytes():
    from shared.weightsync.patches import encode, gap_bytes

    indices = np.array([0, 1, 255, 510, 511, 70_000, 70_254, 999_999])
    assert list(gap_bytes(np.array([0, 255, 511]))) == [0, 255, 0, 255, 1]  # 255 = 255 + 0; 256 = 255 + 1
    blob, index_nbytes = encode(indices, np.arange(8, dtype=np.int32))
    spec = spec_with_patch(blob, 8, index_nbytes, numel=1_000_000)
    got, bits = decode(blob, spec)
    assert list(got) == list(indices) and list(bits) == list(range(8))


def test_a_tensor_found_dense_goes_whole_uncompared_for_a_while_then_is_tried_again():
    from shared.weightsync.patches import DENSE_REST

    gen = torch.Generator().manual_seed(0)
    states = [{"w": torch.randn(4096, generator=gen)}]
    for _ in range(DENSE_REST + 1):
        states.append({"w": states[-1]["w"] * 1.01})  # every element changes
    states.append({"w": states[-1]["w"].clone()})  # then none does
    bases = [base for base, _, _ in encoded(states)]
    assert bases[: DENSE_REST + 2] == [0] * (DENSE_REST + 2)  # whole: first, dense, then resting
    assert bases[-1] == len(states) - 1  # tried again after its rest: an unchanged tensor is a patch


def test_a_version_mostly_changed_goes_whole_and_rests_though_some_tensors_would_patch():
    from shared.weightsync.patches import DENSE_REST

    gen = torch.Generator().manual_seed(0)
    first = {"dense": torch.randn(3 * 4096, generator=gen), "sparse": torch.randn(4096, generator=gen)}
    second = {"dense": first["dense"] * 1.01, "sparse": changed_copy(first["sparse"], 0.3, 1)}
    third = {"dense": second["dense"].clone(), "sparse": second["sparse"].clone()}  # nothing changes
    (_, _, _), (base, specs, payloads), (rest_base, _, _) = encoded([first, second, third])
    # alone, "sparse" would patch (30 % of it changed), but with "dense" whole the version is > half its bytes
    assert base == 0 and not any(spec.HasField("patch") for spec in specs)
    for name in ("sparse", "dense"):  # bit for bit (a NaN among the changes)
        assert torch.equal(payloads[name].view(torch.int32), second[name].view(torch.int32))
    assert rest_base == 0  # every tensor rests, uncompared, though nothing changed
    # and alone the sparse tensor is a patch
    (_, _, _), (alone, (spec,), _) = encoded([{"sparse": first["sparse"]}, {"sparse": second["sparse"]}])
    assert alone == 1 and spec.HasField("patch") and spec.patch.count == int(0.3 * 4096)
    assert DENSE_REST > 1


def test_patches_are_refused_before_start_where_no_replica_could_apply_one():
    from pathlib import Path

    from steadyrl.recipe import load_recipe

    demo = Path(__file__).resolve().parents[2] / "configs" / "tiny-arith.toml"
    assert load_recipe(demo).trainer.publish.patches is False  # off unless asked for
    assert load_recipe(demo, ["trainer.publish.patches=true"]).trainer.publish.patches is True
    with pytest.raises(ValueError, match="trainer.publish.patches: the torch engine applies a patch only"):
        load_recipe(demo, ["trainer.publish.patches=true", "inference.quantization=fp8"])
    with pytest.raises(ValueError, match="weightsync.retain_versions is 1; set it to 2 or more"):
        load_recipe(demo, ["trainer.publish.patches=true", "weightsync.retain_versions=1"])
    assert load_recipe(
        demo, ["trainer.publish.patches=true", "weightsync.retain_versions=2"]
    ).weightsync.retain_versions


def test_a_patch_that_decompresses_past_its_entry_is_refused_after_reading_at_most_that():
    """A decompression bomb (a few KiB of zstd expanding to 256 MiB, its size in the frame header) in either
    stream of a patch for 3 elements: refused as soon as it passes what the entry allows."""
    import zstandard

    from shared.weightsync.patches import bounded, gap_bytes

    bomb = zstandard.ZstdCompressor(level=19, write_content_size=True).compress(bytes(256 << 20))
    assert len(bomb) < 64 << 10
    index = zstandard.ZstdCompressor().compress(gap_bytes(np.array([3, 7, 9])).tobytes())
    values = zstandard.ZstdCompressor().compress(np.ones(3, np.int16).tobytes())
    numel = 4096 * 4096
    for blob, index_nbytes in ((bomb + values, len(bomb)), (index + bomb, len(index))):
        spec = spec_with_patch(blob, 3, index_nbytes, numel=numel)
        spec.dtype, spec.nbytes = "bfloat16", 2 * numel
        with pytest.raises(WeightError, match="decompresses past the"):
            decode(blob, spec)
    assert bounded(values, 6, "w") == np.ones(3, np.int16).tobytes()
    with pytest.raises(WeightError, match="decompresses past the 5 bytes"):
        bounded(values, 5, "w")
