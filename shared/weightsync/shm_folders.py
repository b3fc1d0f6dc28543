"""Where a run's shared-memory version files live, and what removes them: a folder per run instance
(`<root>/<run_id>/<instance>`), so that two runs of one recipe on one host never write, prune or
remove each other's files, claimed by the run that writes it for as long as it lives (an flock its
death releases), so that a later run of the recipe removes what a killed one left in RAM
(docs/internals/weights.md)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import time
from pathlib import Path

from shared.runstore.run_instance import valid_instance
from shared.runtime.private_files import private_dir


def run_folder(root: Path, run_id: str, instance: str) -> Path:
    """The folder of a run's version files: `<root>/<run_id>/<instance>`; `<root>/<run_id>` for
    unsigned weights (no instance). A restarted trainer of the same run (same instance) finds its own."""
    return Path(root) / run_id / instance if instance else Path(root) / run_id


def _lock_path(folder: Path) -> Path:
    return folder.with_name(f".{folder.name}.lock")


def claim_run_folder(root: Path, run_id: str, instance: str, wait_seconds: float = 5.0) -> int:
    """Hold the instance's folder as a live run's: an open file descriptor with an exclusive flock,
    released when the process that holds it ends however it ends. Close it to let go."""
    lock = _lock_path(run_folder(root, run_id, instance))
    private_dir(lock.parent)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    for _ in range(max(1, round(wait_seconds / 0.1))):  # another run's sweep holds it a moment while it looks
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            time.sleep(0.1)
    os.close(fd)
    raise BlockingIOError(f"{lock} is held by another process: a second run of instance {instance}")


def sweep_run_folders(root: Path, run_id: str, keep: str = "") -> list[Path]:
    """Remove the instance folders of `run_id` that no living process claims (what a killed run
    left), all but `keep`'s; the ones removed. A folder whose claim is held is left alone."""
    parent = Path(root) / run_id
    if not parent.is_dir() or parent.is_symlink():
        return []
    removed = []
    for folder in sorted(parent.iterdir()):
        if folder.name == keep or not valid_instance(folder.name) or folder.is_symlink() or not folder.is_dir():
            continue
        lock = _lock_path(folder)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a living run's
            os.close(fd)
            continue
        try:
            shutil.rmtree(folder, ignore_errors=True)
            with contextlib.suppress(FileNotFoundError):
                lock.unlink()
            removed.append(folder)
        finally:
            os.close(fd)
    return removed


def release_run_folder(root: Path, run_id: str, instance: str, fd: int | None) -> None:
    """Remove the run's own folder and claim at its end; the recipe's folder too once empty."""
    folder = run_folder(root, run_id, instance)
    shutil.rmtree(folder, ignore_errors=True)
    if instance:
        with contextlib.suppress(FileNotFoundError):
            _lock_path(folder).unlink()
        with contextlib.suppress(OSError):  # left while another run of the recipe has a folder there
            folder.parent.rmdir()
    if fd is not None:
        os.close(fd)
