"""Secret files are made whole at their mode and renamed into place: a 0644 file already at the path
does not lend the key its mode, a planted symlink is replaced and its target never written, and a
deployment's key pair is not replaced unless asked (`steadyrl keys DIR --force`). The version
folder in shared memory is the trainer's alone (0700, its owner), its files never opened through a
link."""

import json
import os
import stat

import pytest
import torch
from typer.testing import CliRunner

from shared.runtime.private_files import private_dir, write_private
from shared.weightsync.manifest import WeightError
from shared.weightsync.shm import map_version, write_shm
from shared.weightsync.signing import Signer, Verifier, write_key_pair
from steadyrl.cli import app


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_secret_is_written_whole_at_its_mode_and_never_through_a_link(tmp_path):
    old = os.umask(0)  # a permissive umask does not widen it
    try:
        loose = tmp_path / "token"
        loose.write_text("old")
        os.chmod(loose, 0o644)
        with pytest.raises(FileExistsError, match="not replaced"):
            write_private(loose, "new")
        write_private(loose, "new", replace=True)
        assert loose.read_text() == "new" and mode(loose) == 0o600
        target = tmp_path / "elsewhere"
        target.write_text("operator's file")
        planted = tmp_path / "key"
        planted.symlink_to(target)
        with pytest.raises(FileExistsError):
            write_private(planted, "secret")
        write_private(planted, "secret", replace=True)
        assert not planted.is_symlink() and planted.read_text() == "secret" and mode(planted) == 0o600
        assert target.read_text() == "operator's file"
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging file left
    finally:
        os.umask(old)


def test_a_key_pair_is_not_replaced_unless_forced(tmp_path):
    private, public = write_key_pair(tmp_path / "keys")
    assert (mode(private), mode(public), mode(tmp_path / "keys")) == (0o600, 0o644, 0o700)
    first = private.read_text()
    with pytest.raises(FileExistsError, match="not replaced"):
        write_key_pair(tmp_path / "keys")
    assert private.read_text() == first
    runner = CliRunner()
    refused = runner.invoke(app, ["keys", str(tmp_path / "keys")])
    assert refused.exit_code != 0 and "not replaced (pass --force" in refused.output
    assert private.read_text() == first
    forced = runner.invoke(app, ["keys", str(tmp_path / "keys"), "--force"])
    assert forced.exit_code == 0, forced.output
    assert private.read_text() != first and mode(private) == 0o600
    assert json.loads(forced.output)["verify_key"] == public.read_text().strip()


def test_a_signature_covers_the_run_instance(tmp_path):
    private, public = write_key_pair(tmp_path / "keys")
    from shared.rpc.steadyrl.v1 import weightsync_pb2 as pb

    earlier = Signer.from_file(private, "demo", "a" * 32).sign(pb.WeightManifest(version=500))
    this = Signer.from_file(private, "demo", "b" * 32).sign(pb.WeightManifest(version=1))
    verifier = Verifier.from_file(public, "demo", "b" * 32)
    verifier.check(this)
    with pytest.raises(WeightError, match="another instance of run 'demo'"):
        verifier.check(earlier)
    forged = pb.WeightManifest()
    forged.CopyFrom(earlier)
    forged.run_instance = "b" * 32  # relabelled: the signature no longer matches
    with pytest.raises(WeightError, match="signature is not the run's trainer's"):
        verifier.check(forged)


def test_the_version_folder_is_private_and_its_files_are_not_followed(tmp_path):
    tensors = {"w": torch.arange(6, dtype=torch.float32)}
    folder = tmp_path / "shm" / "run"
    write_shm(folder / "v1.safetensors", tensors, 1, 0)
    assert mode(folder) == 0o700
    os.chmod(folder, 0o755)  # this user's, loosened (as an earlier version made them): closed again
    write_shm(folder / "v2.safetensors", tensors, 2, 1)
    assert mode(folder) == 0o700
    if os.geteuid() == 0:  # another user's folder is refused, not written into
        os.chown(folder, 65534, 65534)
        with pytest.raises(WeightError, match="belongs to user 65534"):
            write_shm(folder / "v4.safetensors", tensors, 4, 3)
        os.chown(folder, 0, 0)
    link = tmp_path / "shm" / "link"
    link.symlink_to(folder)
    with pytest.raises(PermissionError, match="not a directory of its own"):
        private_dir(link)
    planted = folder / "v3.safetensors"
    planted.symlink_to(folder / "v1.safetensors")
    with pytest.raises(WeightError, match="v3.safetensors"):
        map_version(planted)  # a reader never follows a link planted as a version file
    write_shm(planted, tensors, 3, 2)  # the writer replaces it, never writes through it
    assert not planted.is_symlink() and map_version(folder / "v1.safetensors")[1]["w"]["shape"] == [6]
