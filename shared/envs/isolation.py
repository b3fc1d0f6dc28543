"""Programs the run does not trust run in a view of the machine made by bubblewrap (`bwrap`, the Debian package
`bubblewrap`): a user namespace with no capabilities in which no further user namespace can be made, new PID, IPC,
UTS and network namespaces, read-only binds of only what the program needs, tmpfs where it may write, an empty
environment but for what is given; the caller adds a seccomp deny-list (`shared.envs.seccomp`). Two views:
`sandbox_argv` (model-written code) and `agent_argv` (agent programs: their own files, reaching only their
endpoint). Where bwrap cannot run, `unavailable()` says why and nothing runs unconfined. The threat model:
docs/security.md.

Details: docs/internals/inference.md"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from shared.envs import seccomp

SYSTEM_DIRS = ("/usr", "/lib", "/lib32", "/lib64", "/libx32", "/bin", "/sbin")
# what of /etc an agent program's own interpreter may need (the dynamic loader, alternatives' links, the time zone)
AGENT_ETC = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "localtime")
NAMESPACES = (
    "--unshare-user",
    "--unshare-pid",
    "--unshare-ipc",
    "--unshare-uts",
    "--unshare-net",
    "--unshare-cgroup-try",
)
AGENT_DIR = "/.steadyrl"  # inside an agent's sandbox: its forwarder and the endpoint's socket


def bwrap() -> str | None:
    return shutil.which("bwrap")


@functools.cache
def disables_userns() -> bool:
    """Whether bubblewrap's `--disable-userns` is passed: this bubblewrap has it (0.8 and later; Ubuntu 22.04's 0.6
    has not) and it works here (it writes the user.max_user_namespaces sysctl inside the sandbox, which a read-only
    /proc/sys refuses). Elsewhere the seccomp deny-list alone keeps new user namespaces out."""
    path = bwrap()
    if path is None:
        return False
    probe = [path, *NAMESPACES, "--disable-userns", "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev", "true"]
    try:
        listed = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=30)
        return (
            "--disable-userns" in listed.stdout
            and subprocess.run(probe, capture_output=True, timeout=30).returncode == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        return False


@functools.cache
def unavailable() -> str | None:
    """Why isolated programs cannot run here (None when they can): bubblewrap missing, the kernel refusing it the
    namespaces it needs (its own message), or no seccomp program known for this architecture."""
    path = bwrap()
    if path is None:
        return "bubblewrap (bwrap) is not installed: apt-get install bubblewrap"
    unknown = seccomp.unknown()
    if unknown is not None:
        return f"{unknown}: untrusted programs are not run here"
    try:
        probe = subprocess.run(
            [*_common({}), "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev", "--", "true"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bubblewrap could not run: {exc}"
    if probe.returncode != 0:
        return f"bubblewrap could not make its namespaces: {probe.stderr.strip()[-300:] or probe.returncode}"
    return None


def _common(env: dict[str, str]) -> list[str]:
    argv = [
        bwrap() or "bwrap",
        *NAMESPACES,
        *(["--disable-userns"] if disables_userns() else []),
        "--die-with-parent",
        "--new-session",
        "--cap-drop",
        "ALL",
        "--clearenv",
    ]
    for name, value in env.items():
        argv += ["--setenv", name, value]
    return argv


def _system_mounts(etc: tuple[str, ...] = ("ld.so.cache",)) -> list[str]:
    """The system's library and binary directories read-only (merged-/usr symlinks kept as links), the files of
    /etc named in `etc`, and the interpreter's own prefix."""
    argv: list[str] = []
    for path in SYSTEM_DIRS:
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    prefix = os.path.realpath(sys.base_prefix)
    if not _system(prefix):
        argv += ["--ro-bind", prefix, prefix]
    for name in etc:
        if os.path.lexists(f"/etc/{name}"):
            argv += ["--ro-bind", f"/etc/{name}", f"/etc/{name}"]
    return argv


def _system(path: str) -> bool:
    return any(path == d or path.startswith(d + "/") for d in SYSTEM_DIRS)


def interpreter() -> str:
    """The real Python binary (a virtualenv's is a link to it): with -I -S it needs only its prefix."""
    return os.path.realpath(sys.executable)


def sandbox_argv(
    code: Path, files: dict[str, Path], disk_bytes: int, command: list[str], seccomp_fd: int | None = None
) -> list[str]:
    """bwrap's argv for model-written code: `code`'s directory is never visible, only `code`
    itself as /scratch/code.py (read-only) in a scratch tmpfs of `disk_bytes`; `files` are extra
    read-only files (inside path → host path); no network; `command` runs in /scratch, under the
    seccomp program read from `seccomp_fd` (the caller always gives one; None only to test the rest)."""
    env = {"HOME": "/scratch", "TMPDIR": "/scratch", "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
    argv = [
        *_common(env),
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
    command: list[str],
    env: dict[str, str],
    own: list[Path],
    hidden: list[Path],
    tmp_bytes: int,
    files: dict[str, Path],
    cwd: str | None = None,
    seccomp_fd: int | None = None,
) -> list[str]:
    """bwrap's argv for an agent program: the system and `own` (its files, its interpreter) read-only at their
    own paths, each of `hidden` inside them replaced by an empty read-only tmpfs; `files` (inside path → host
    path: the forwarder and the endpoint's socket) under AGENT_DIR; a /tmp (its HOME and TMPDIR) and a /dev/shm
    of its own, each at most `tmp_bytes`; no network but its own loopback. It starts in `cwd` (an empty
    directory but for what of it is `own`), or /tmp when that is hidden."""
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", **env, "HOME": "/tmp", "TMPDIR": "/tmp"}
    argv = [
        *_common(env),
        *_system_mounts(AGENT_ETC),
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
    for path in sorted({str(p) for p in own}):
        argv += ["--ro-bind", path, path]
    for path in _masks(own, hidden):
        argv += ["--tmpfs", path, "--remount-ro", path]
    for inside, host in files.items():
        argv += ["--ro-bind", str(host), inside]
    cwd = os.path.abspath(cwd or os.getcwd())
    hidden_dirs = [str(d) for p in hidden if (d := _directory(p)) is not None]
    start = "/tmp" if any(_within(os.path.realpath(cwd), m) for m in hidden_dirs) else cwd
    argv += ["--dir", start]
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
    return [*argv, "--remount-ro", "/", "--chdir", start, "--", *command]


def _masks(own: list[Path], hidden: list[Path]) -> list[str]:
    """Where each of `hidden` shows inside the sandbox: at the path of each `own` it lies in (`own` is bound
    at the path it is named by, which may be a link to where it is)."""
    out = set()
    for directory in (d for p in hidden if (d := _directory(p)) is not None):
        for path in own:
            real = os.path.realpath(path)
            if _within(str(directory), real):
                out.add(str(path) + str(directory)[len(real) :] if real != "/" else str(directory))
    return sorted(out)


def program_paths(command: list[str], cwd: str, search_path: str) -> list[Path]:
    """What of the host an agent program's command names as its own, beside the system: its executable's
    installation (a virtual environment's or a Python's whole directory, else the executable's directory; and the
    same of the binary its links lead to), each existing path the command names (a file: its directory), and for
    `-m MODULE` that module's top package in `cwd`. A directory that would show more than the program's own
    (`/`, the home directory or one above it, ~/.local, ~/.config, ~/.cache, the temporary directory, /etc, /var,
    /run) is never taken: a file in it is taken alone."""
    out: list[Path] = []
    executable = command[0] if "/" in command[0] else shutil.which(command[0], path=search_path)
    if executable is not None:
        path = Path(cwd, executable)
        for named in (path, Path(os.path.realpath(path))):
            if named.exists() and not _system(str(named)):
                out.append(_installation(named))
    for before, word in zip(command, command[1:], strict=False):
        if before == "-m":
            top = word.split(".")[0]
            out += [p for p in (Path(cwd, top), Path(cwd, top + ".py")) if top and _exists(p)]
        elif not word.startswith("-") and _exists(Path(cwd, word)) and not _system(os.path.abspath(Path(cwd, word))):
            named = Path(os.path.abspath(Path(cwd, word)))
            if named.is_dir():  # a directory named whole: bound unless it shows more than the program's own
                out += [] if _broad(named) or _private(named) else [named]
            else:  # a file: its directory, or the file alone where that directory holds others' secrets
                directory = named.parent
                out.append(named if _broad(directory) or _private(directory) else directory)
    return [p for p in dict.fromkeys(out) if not _broad(p)]


def _private(path: Path) -> bool:
    """Whether `path` lies in a hidden directory of the home directory (~/.ssh, ~/.aws, ~/.gnupg,
    ~/.kube, ~/.pyenv, ...) or is a top-level directory (/work): a file named there is bound alone,
    never the directory beside it. Read-only paths the operator names are bound whatever they are."""
    real = os.path.realpath(path)
    if real.count("/") == 1:
        return True
    for home in {os.path.realpath(os.path.expanduser("~")), os.path.realpath(os.environ.get("HOME", "/"))}:
        inside = home != "/" and _within(real, home) and real != home
        if inside and any(part.startswith(".") for part in Path(os.path.relpath(real, home)).parts):
            return True
    return False


def _exists(path: Path) -> bool:
    """Whether `path` names something: an argument that cannot be a path (too long, a NUL) names nothing."""
    try:
        return path.exists()
    except (OSError, ValueError):
        return False


def _installation(path: Path, bin_parent: bool = True) -> Path:
    """The directory a file belongs to: for a file in a `bin` directory, that directory's parent when it is a
    virtual environment (`pyvenv.cfg`) or a Python's prefix (`lib/python*` beside a `python*` binary), else the
    file's own directory; the file alone where that directory is too broad."""
    directory = path.parent
    if bin_parent and directory.name == "bin" and not _broad(directory.parent):
        prefix = directory.parent
        if (prefix / "pyvenv.cfg").exists() or (path.name.startswith("python") and any(prefix.glob("lib/python*"))):
            return prefix
    return path if _broad(directory) else directory


def _broad(path: Path) -> bool:
    """Whether binding `path` would show more than a program's own files."""
    real = os.path.realpath(path)
    tops = ("/", "/etc", "/var", "/run", "/dev", "/proc", "/sys", "/home", "/media", "/mnt", "/srv", "/opt")
    homes = {os.path.realpath(os.path.expanduser("~")), os.path.realpath(os.environ.get("HOME", "/"))}
    shared = {
        os.path.join(h, name) for h in homes for name in (".local", ".local/share", ".local/lib", ".config", ".cache")
    }
    temporary = {os.path.realpath(tempfile.gettempdir()), "/tmp", "/var/tmp", "/dev/shm"}
    return real in tops or real in temporary or real in shared or any(_within(home, real) for home in homes)


def _within(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def _directory(path: Path) -> Path | None:
    """The directory to hide for `path` (itself, or a file's parent); None when it is not there
    or is the root."""
    path = Path(path).resolve()
    directory = path if path.is_dir() else path.parent if path.exists() else None
    return directory if directory is not None and directory != Path("/") else None
