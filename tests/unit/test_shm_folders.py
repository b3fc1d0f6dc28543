"""A run's shared-memory version folder: one per run instance, claimed while its run lives; a later
run of the recipe removes the unclaimed ones (what a killed run left), never a living run's."""

import os

import pytest

from shared.weightsync.shm_folders import claim_run_folder, release_run_folder, run_folder, sweep_run_folders

A, B, C = "a" * 32, "b" * 32, "c" * 32


def with_files(root, instance):
    folder = run_folder(root, "demo", instance)
    folder.mkdir(mode=0o700, parents=True)
    (folder / "v1.safetensors").write_bytes(b"x" * 10)
    return folder


def test_each_instance_has_its_folder_and_unsigned_weights_the_recipe_folder(tmp_path):
    assert run_folder(tmp_path, "demo", A) == tmp_path / "demo" / A
    assert run_folder(tmp_path, "demo", "") == tmp_path / "demo"


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
    assert sweep_run_folders(tmp_path, "absent") == []


def test_a_claimed_folder_cannot_be_claimed_twice(tmp_path):
    held = claim_run_folder(tmp_path, "demo", A)
    try:
        with pytest.raises(BlockingIOError, match="held by another process"):
            claim_run_folder(tmp_path, "demo", A, wait_seconds=0.2)
    finally:
        os.close(held)


def test_a_run_removes_its_own_folder_and_the_recipe_folder_once_empty(tmp_path):
    mine, theirs = with_files(tmp_path, A), with_files(tmp_path, B)
    release_run_folder(tmp_path, "demo", A, claim_run_folder(tmp_path, "demo", A))
    assert not mine.exists() and theirs.exists() and sorted(p.name for p in (tmp_path / "demo").iterdir()) == [B]
    release_run_folder(tmp_path, "demo", B, None)
    assert not (tmp_path / "demo").exists()
