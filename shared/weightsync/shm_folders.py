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
import stat
import time
from pathlib import Path

from shared.runstore.keys import check_run_id
from shared.runstore.run_instance import INSTANCE_CHARS, valid_instance
from shared.runtime.private_files import private_dir


def run_folder(root: Path, run_id: str, instance: str) -> Path:
    """The folder of a run's version files: `<root>/<run_id>/<instance>`; `<root>/<run_id>` for
    unsigned weights (no instance). A restarted trainer of the same run (same instance) finds its own.
    ValueError for a run id or instance that is not one path component of its kind."""
    check_run_id(run_id)
    if instance and not valid_instance(instance):
        raise ValueError(f"instance {instance!r} is not {INSTANCE_CHARS} lower-case hexadecimal characters")
    return Path(root) / run_id / instance if instance else Path(root) / run_id


def _lock_path(folder: Path) -> Path:
    return folder.with_name(f".{folder.name}.lock")


def _open_lock(lock: Path) -> int:
    return os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o600)


def claim_run_folder(root: Path, run_id: str, instance: str, wait_seconds: float = 5.0) -> int:
    """Hold the instance's folder as a live run's: an open file descriptor with an exclusive flock,
    released when the process that holds it ends however it ends. Close it to let go."""
    if not instance:
        raise ValueError("only a run with an instance (signed weights) claims a folder")
    if not 0 <= wait_seconds < float("inf"):
        raise ValueError(f"wait_seconds {wait_seconds!r}: finite and >= 0")
    lock = _lock_path(run_folder(root, run_id, instance))
    for _ in range(max(1, round(wait_seconds / 0.1))):  # another run's sweep or release holds it a moment
        private_dir(lock.parent)
        try:
            fd = _open_lock(lock)
        except FileNotFoundError:  # the recipe's folder, removed by a run that ended just now
            continue
        except OSError as exc:
            raise OSError(f"{lock} cannot be this run's claim (a link, a folder or unreadable): {exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            os.close(fd)
            time.sleep(0.1)
    raise BlockingIOError(f"{lock} is held by another process: a second run of instance {instance}")


def sweep_run_folders(root: Path, run_id: str, keep: str = "") -> list[Path]:
    """Remove the instance folders of `run_id` that no living process claims (what a killed run
    left), all but `keep`'s; the ones removed. A folder whose claim is held, one of another user and
    one whose claim cannot be opened are left alone; a recipe folder of another user is refused
    (PermissionError, as the trainer would refuse it)."""
    parent = Path(root) / check_run_id(run_id)
    if not parent.exists() and not parent.is_symlink():
        return []
    private_dir(parent)
    removed = []
    for folder in sorted(parent.iterdir()):
        if folder.name == keep or not valid_instance(folder.name):
            continue
        info = os.lstat(folder)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
            continue
        try:
            fd = _open_lock(_lock_path(folder))
        except OSError:  # a link or a folder where the claim goes: not a run's, left alone
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a living run's
            os.close(fd)
            continue
        try:
            shutil.rmtree(folder, ignore_errors=True)
            with contextlib.suppress(FileNotFoundError):
                _lock_path(folder).unlink()
            removed.append(folder)
        finally:
            os.close(fd)
    for lock in sorted(parent.glob(".*.lock")):  # claims of runs that ended before their first version
        if valid_instance(lock.name[1:-5]) and lock.name[1:-5] != keep and not (parent / lock.name[1:-5]).exists():
            _drop_unheld(lock)
    return removed


def _drop_unheld(lock: Path) -> None:
    try:
        fd = _open_lock(lock)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        lock.unlink(missing_ok=True)
    except BlockingIOError:  # a living run's, before its first version
        pass
    finally:
        os.close(fd)


def release_run_folder(root: Path, run_id: str, instance: str, claim: int | None) -> bool:
    """At a run's end, remove its own folder and claim (the recipe's folder too once empty): only
    when `claim` is the flock this process holds on it (else nothing is removed; a later run's
    sweep will). Unsigned weights (no instance): the version files directly in the recipe's folder.
    Whether anything was removed."""
    folder = run_folder(root, run_id, instance)
    if not instance:
        for path in folder.glob("v*.safetensors"):
            if path.is_file() and not path.is_symlink() and os.lstat(path).st_uid == os.geteuid():
                path.unlink(missing_ok=True)
        return True
    lock = _lock_path(folder)
    try:
        if claim is None or os.fstat(claim).st_ino != os.lstat(lock).st_ino:
            return False
        fcntl.flock(claim, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held by this very descriptor: succeeds at once
    except (OSError, BlockingIOError):
        return False
    shutil.rmtree(folder, ignore_errors=True)
    lock.unlink(missing_ok=True)
    os.close(claim)
    with contextlib.suppress(OSError):  # left while another run of the recipe has a folder there
        folder.parent.rmdir()
    return True
