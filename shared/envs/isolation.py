"""Programs the run does not trust run in a view of the machine made by bubblewrap (`bwrap`, the Debian package
`bubblewrap`): a user namespace with no capabilities, new PID, IPC and UTS namespaces, read-only binds, tmpfs where
it may write, an empty environment but for what is given. Two views: `sandbox_argv` (model-written code, no network)
and `agent_argv` (agent programs: the host read-only, the host's network). Where bwrap cannot run, `unavailable()`
says why and nothing runs unconfined. The threat model: docs/security.md.

Details: docs/internals/inference.md"""

from __future__ import annotations

import functools
import os
import platform
import shutil
import struct
import subprocess
import sys
from pathlib import Path

SYSTEM_DIRS = ("/usr", "/lib", "/lib64", "/bin", "/sbin")
NO_NAMESPACES = ("--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try")


def bwrap() -> str | None:
    return shutil.which("bwrap")


@functools.cache
def unavailable() -> str | None:
    """Why isolated programs cannot run here (None when they can): bubblewrap missing, or the
    kernel refusing it the namespaces it needs (its own message)."""
    path = bwrap()
    if path is None:
        return "bubblewrap (bwrap) is not installed: apt-get install bubblewrap"
    try:
        probe = subprocess.run(
            [
                path,
                *NO_NAMESPACES,
                "--unshare-net",
                "--ro-bind",
                "/",
                "/",
                "--proc",
                "/proc",
                "--dev",
                "/dev",
                "--",
                "true",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bubblewrap could not run: {exc}"
    if probe.returncode != 0:
        return f"bubblewrap could not make its namespaces: {probe.stderr.strip()[-300:] or probe.returncode}"
    return None


def _common(network: bool, env: dict[str, str]) -> list[str]:
    argv = [
        bwrap() or "bwrap",
        *NO_NAMESPACES,
        *([] if network else ["--unshare-net"]),
        "--die-with-parent",
        "--new-session",
        "--cap-drop",
        "ALL",
        "--clearenv",
    ]
    for name, value in env.items():
        argv += ["--setenv", name, value]
    return argv


def _system_mounts() -> list[str]:
    """The system's library and binary directories read-only (merged-/usr symlinks kept as links),
    the dynamic loader's cache, and the interpreter's own prefix."""
    argv: list[str] = []
    for path in SYSTEM_DIRS:
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    prefix = os.path.realpath(sys.base_prefix)
    if not any(prefix == d or prefix.startswith(d + "/") for d in SYSTEM_DIRS):
        argv += ["--ro-bind", prefix, prefix]
    if os.path.exists("/etc/ld.so.cache"):
        argv += ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    return argv


def interpreter() -> str:
    """The real Python binary (a virtualenv's is a link to it): with -I -S it needs only its prefix."""
    return os.path.realpath(sys.executable)


def sandbox_argv(
    code: Path, files: dict[str, Path], disk_bytes: int, command: list[str], seccomp_fd: int | None = None
) -> list[str]:
    """bwrap's argv for model-written code: `code`'s directory is never visible, only `code`
    itself as /scratch/code.py (read-only) in a scratch tmpfs of `disk_bytes`; `files` are extra
    read-only files (inside path → host path); no network; `command` runs in /scratch, under the
    seccomp program read from `seccomp_fd` when one is given."""
    env = {"HOME": "/scratch", "TMPDIR": "/scratch", "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
    argv = [
        *_common(False, env),
        *_system_mounts(),
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--remount-ro",
        "/dev",
        "--size",
        str(disk_bytes),
        "--tmpfs",
        "/scratch",
        "--ro-bind",
        str(code),
        "/scratch/code.py",
    ]
    for inside, host in files.items():
        argv += ["--ro-bind", str(host), inside]
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
    return [*argv, "--remount-ro", "/", "--chdir", "/scratch", "--", *command]


def agent_argv(
    command: list[str], env: dict[str, str], hidden: list[Path], tmp_bytes: int, cwd: str | None = None
) -> list[str]:
    """bwrap's argv for an agent program: the host read-only, a /tmp (its HOME and TMPDIR) and a
    /dev/shm of its own, each at most `tmp_bytes`, each of `hidden` (directories, or a file's
    directory) replaced by an empty read-only tmpfs; `cwd` kept when it is still visible."""
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", **env, "HOME": "/tmp", "TMPDIR": "/tmp"}
    argv = [
        *_common(True, env),
        "--ro-bind",
        "/",
        "/",
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--size",
        str(tmp_bytes),
        "--tmpfs",
        "/dev/shm",
        "--remount-ro",
        "/dev",
        "--size",
        str(tmp_bytes),
        "--tmpfs",
        "/tmp",
    ]
    masked = sorted({str(_directory(p)) for p in hidden if _directory(p) is not None})
    for path in masked:
        argv += ["--tmpfs", path, "--remount-ro", path]
    cwd = cwd or os.getcwd()
    visible = not any(cwd == m or cwd.startswith(m.rstrip("/") + "/") for m in [*masked, "/tmp"])
    return [*argv, "--chdir", cwd if visible else "/tmp", "--", *command]


def _directory(path: Path) -> Path | None:
    """The directory to hide for `path` (itself, or a file's parent); None when it is not there
    or is the root."""
    path = Path(path).resolve()
    directory = path if path.is_dir() else path.parent if path.exists() else None
    return directory if directory is not None and directory != Path("/") else None


# seccomp: the syscalls that make a process or thread, per architecture (audit arch, numbers)
_SPAWNING = {"x86_64": (0xC000003E, (56, 57, 58, 435)), "aarch64": (0xC00000B7, (220, 435))}
_X32 = 0x40000000


def no_new_processes_filter() -> bytes | None:
    """A seccomp program (classic BPF, as bubblewrap's `--seccomp FD` reads it) that fails every
    clone, clone3, fork and vfork with EAGAIN: the sandbox's code stays one process, so limits
    per process are limits per call. None on an architecture this does not know."""
    known = _SPAWNING.get(platform.machine())
    if known is None:
        return None
    arch, numbers = known
    ld_w_abs = 0x20
    jeq_k = 0x15
    jge_k = 0x35
    ret_k = 0x06
    allow = 0x7FFF0000
    eagain = 0x00050000 | 11  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO | EAGAIN
    program = [(ld_w_abs, 0, 0, 4), (jeq_k, 1, 0, arch), (ret_k, 0, 0, eagain), (ld_w_abs, 0, 0, 0)]
    count = len(numbers)
    program.append((jge_k, count + 1, 0, _X32) if arch == 0xC000003E else (jeq_k, 0, 0, 0))
    for i, number in enumerate(numbers):
        program.append((jeq_k, count - i, 0, number))
    program += [(ret_k, 0, 0, allow), (ret_k, 0, 0, eagain)]
    return b"".join(struct.pack("=HBBI", *op) for op in program)
