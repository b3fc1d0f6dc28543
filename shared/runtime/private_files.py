"""Files that hold a secret (a signing key, the run's token), written so that nothing else can read
or redirect them: a new file made with O_CREAT | O_EXCL | O_NOFOLLOW at its final mode (never
chmodded after the secret is in it), written, synced, then renamed into place — an existing file
keeps nothing of its own (its mode, its owner), and a symlink planted at the path is replaced, not
followed. A file already there is refused unless `replace` (docs/security.md)."""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path


def write_private(path: Path, data: str, mode: int = 0o600, replace: bool = False) -> Path:
    """`data` into `path` at `mode`; FileExistsError when `path` exists (a link included) and not
    `replace`."""
    path = Path(path)
    if not replace and (path.exists() or path.is_symlink()):
        raise FileExistsError(f"{path} exists: it is not replaced (pass --force to replace it)")
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{secrets.token_hex(8)}")
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), mode)  # the umask may have taken bits the mode asked for
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.rename(staging, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(staging)
        raise
    return path


def private_dir(path: Path) -> Path:
    """`path` as a directory only this user may enter: made 0700 (its missing parents too) when new;
    when there, PermissionError unless this user owns it and it is no symlink (a folder another user
    made first could hand its files to them, or swap them); one of this user's open to others (an
    earlier version made them 0755) is closed to 0700."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        for parent in reversed([path, *path.parents]):
            if not parent.exists():
                with contextlib.suppress(FileExistsError):  # made meanwhile: checked below like any
                    os.mkdir(parent, 0o700)
    info = os.lstat(path)
    if os.path.islink(path) or not os.path.isdir(path):
        raise PermissionError(f"{path} is not a directory of its own (a link or a file)")
    if info.st_uid != os.geteuid():
        raise PermissionError(f"{path} belongs to user {info.st_uid}, not to this process's ({os.geteuid()})")
    if info.st_mode & 0o077:
        os.chmod(path, 0o700, follow_symlinks=False)
    return path
