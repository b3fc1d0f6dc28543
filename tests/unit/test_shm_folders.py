"""A run's shared-memory version folder: one per run instance, claimed while its run lives; a later
run of the recipe removes the unclaimed ones (what a killed run left), never a living run's, another
user's or anything outside the root, whatever names, links and owners it meets."""

import os
import subprocess
import sys

import pytest

from shared.weightsync.shm_folders import claim_run_folder, release_run_folder, run_folder, sweep_run_folders

A, B, C = "a" * 32, "b" * 32, "c" * 32
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="planting another user's files needs root")


def with_files(root, instance, run_id="demo"):
    folder = run_folder(root, run_id, instance)
    folder.mkdir(mode=0o700, parents=True)
    (folder / "v1.safetensors").write_bytes(b"x" * 10)
    return folder


def test_each_instance_has_its_folder_and_unsigned_weights_the_recipe_folder(tmp_path):
    assert run_folder(tmp_path, "demo", A) == tmp_path / "demo" / A
    assert run_folder(tmp_path, "demo", "") == tmp_path / "demo"


@pytest.mark.parametrize("run_id", ["..", ".", "../victim", "a/b", "/abs", "", "x\x00", "a\\b"])
def test_a_run_id_that_is_no_single_name_reaches_nothing(tmp_path, run_id):
    victim = with_files(tmp_path / "victim", A, "r")
    for call in (
        lambda: run_folder(tmp_path / "root", run_id, A),
        lambda: sweep_run_folders(tmp_path / "root", run_id),
        lambda: claim_run_folder(tmp_path / "root", run_id, A),
        lambda: release_run_folder(tmp_path / "root", run_id, A, None),
    ):
        with pytest.raises(ValueError, match="run_id"):
            call()
    assert (victim / "v1.safetensors").read_bytes() == b"x" * 10


@pytest.mark.parametrize("instance", ["..", "../../victim", "A" * 32, "a" * 31, "a" * 33, "a/b", "zz"])
def test_an_instance_that_is_not_32_hex_characters_reaches_nothing(tmp_path, instance):
    (tmp_path / "root" / "demo").mkdir(parents=True)
    for call in (
        lambda: claim_run_folder(tmp_path / "root", "demo", instance),
        lambda: release_run_folder(tmp_path / "root", "demo", instance, None),
    ):
        with pytest.raises(ValueError, match="instance"):
            call()
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["demo", "root"]


def test_a_sweep_removes_the_unclaimed_folders_alone(tmp_path):
    dead, alive, own = with_files(tmp_path, A), with_files(tmp_path, B), with_files(tmp_path, C)
    other = tmp_path / "demo" / "not-an-instance"
    other.mkdir()
    held = claim_run_folder(tmp_path, "demo", B)  # a living run (its own open file description)
    try:
        assert sweep_run_folders(tmp_path, "demo", keep=C) == [dead]
    finally:
        os.close(held)
    assert not dead.exists() and alive.exists() and own.exists() and other.exists()
    assert sweep_run_folders(tmp_path, "demo", keep=C) == [alive]  # its run ended: the claim went with it
    ended = claim_run_folder(tmp_path, "demo", A)  # a run that ended before its first version
    os.close(ended)
    held = claim_run_folder(tmp_path, "demo", B)  # one living before its first version
    try:
        assert sweep_run_folders(tmp_path, "demo", keep=C) == []
        assert sorted(p.name for p in (tmp_path / "demo").iterdir()) == [f".{B}.lock", C, "not-an-instance"]
    finally:
        os.close(held)
    assert sweep_run_folders(tmp_path, "absent") == []


def test_a_sweep_leaves_links_and_odd_claims_and_goes_on(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("x")
    (tmp_path / "demo").mkdir(mode=0o700)
    (tmp_path / "demo" / A).symlink_to(victim)  # a link as an instance folder
    with_files(tmp_path, B)
    (tmp_path / "demo" / f".{B}.lock").mkdir()  # a folder where its claim goes
    linked = with_files(tmp_path, C)
    (linked / "outside").symlink_to(victim / "keep")  # links inside a dead run's folder: removed, not followed
    assert sweep_run_folders(tmp_path, "demo") == [linked]
    assert (victim / "keep").read_text() == "x" and (tmp_path / "demo" / B).exists()


@as_root
def test_another_users_folders_are_left_or_refused(tmp_path):
    theirs = with_files(tmp_path, A)
    os.chown(theirs, 12345, 12345)
    assert sweep_run_folders(tmp_path, "demo") == [] and theirs.exists()
    os.chown(tmp_path / "demo", 12345, 12345)
    with pytest.raises(PermissionError, match="belongs to user 12345"):
        sweep_run_folders(tmp_path, "demo")


def test_a_claimed_folder_cannot_be_claimed_twice_nor_released_by_another(tmp_path):
    mine = with_files(tmp_path, A)
    holder = subprocess.Popen(
        [sys.executable, "-c", f"import sys, time; from shared.weightsync.shm_folders import claim_run_folder;"
         f" claim_run_folder({str(tmp_path)!r}, 'demo', {A!r}); print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(BlockingIOError, match="held by another process"):
            claim_run_folder(tmp_path, "demo", A, wait_seconds=0.2)
        assert release_run_folder(tmp_path, "demo", A, None) is False
        stranger = os.open(tmp_path / "demo" / f".{A}.lock", os.O_RDONLY)  # the lock file, not its flock
        assert release_run_folder(tmp_path, "demo", A, stranger) is False
        os.close(stranger)
        assert (mine / "v1.safetensors").exists()
    finally:
        holder.kill()
        holder.wait()
    for wait in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match="wait_seconds"):
            claim_run_folder(tmp_path, "demo", A, wait_seconds=wait)


def test_a_run_removes_its_own_folder_and_the_recipe_folder_once_empty(tmp_path):
    mine, theirs = with_files(tmp_path, A), with_files(tmp_path, B)
    assert release_run_folder(tmp_path, "demo", A, claim_run_folder(tmp_path, "demo", A)) is True
    assert not mine.exists() and theirs.exists() and sorted(p.name for p in (tmp_path / "demo").iterdir()) == [B]
    assert release_run_folder(tmp_path, "demo", B, claim_run_folder(tmp_path, "demo", B)) is True
    assert not (tmp_path / "demo").exists()


def test_unsigned_weights_remove_their_version_files_alone(tmp_path):
    other = with_files(tmp_path, A)
    (tmp_path / "demo" / "v3.safetensors").write_bytes(b"unsigned")
    assert release_run_folder(tmp_path, "demo", "", None) is True
    assert sorted(p.name for p in (tmp_path / "demo").iterdir()) == [A] and other.exists()
