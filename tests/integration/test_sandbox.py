"""The code sandbox for real (bubblewrap's namespaces, a cgroup per call where one can be made,
rlimits, this kernel): each escape attempt ends its call with a reason or finds nothing to reach,
the caller's files stay as they were, and the calling process stays healthy."""

import json
import os
import platform
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shared.envs import cgroups, isolation
from shared.envs.sandbox import SandboxLimits, run_python
from tests.syscall_probe import NUMBERS

MACHINE = platform.machine()

LIMITS = SandboxLimits(
    cpu_seconds=1, wall_seconds=4, memory_bytes=256 << 20, max_processes=8, file_bytes=1 << 16, disk_bytes=4 << 20
)
needs_bwrap = pytest.mark.skipif(isolation.unavailable() is not None, reason=f"{isolation.unavailable()}")
pytestmark = needs_bwrap

ATTEMPTS = {
    "network": (
        "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)",
        "error",
        "Network is unreachable",
    ),
    "write_outside": ("open({outside!r}, 'w').write('x')", "error", "No such file or directory"),
    "write_system": ("open('/usr/escaped', 'w').write('x')", "error", "Read-only file system"),
    # it spins: its processes together use the call's CPU time before its wall time is up
    "fork_bomb": (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
        "cpu_limit",
        "",
    ),
    "infinite_loop": ("while True:\n    pass", "cpu_limit", ""),
    "sleep_forever": ("import time\ntime.sleep(1000)", "timeout", ""),
    "memory_bomb": ("x = []\nwhile True:\n    x.append(bytearray(10**7))", "memory", ""),
    "output_flood": ("while True:\n    print('x' * 1000)", "output_limit", "File too large"),
    "disk_flood": (
        "for i in range(150):\n    open('f%d' % i, 'wb').write(b'x' * 60000)",
        "disk_limit",
        "No space left on device",
    ),
}


@pytest.fixture(autouse=True)
def adopt_orphans():
    """This process adopts its calls' orphans while a test runs (a child subreaper), so that what a
    call leaves alive stays among its descendants: another test's sandboxes running beside it (a
    second test worker) are not counted."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_CHILD_SUBREAPER = 36
    assert libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    yield
    libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)  # an adopted one that ended stays a zombie, unmatched


def descends_from_this_process(pid: int) -> bool:
    while pid > 1:
        if pid == os.getpid():
            return True
        try:
            stat_line = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        pid = int(stat_line.rsplit(")", 1)[1].split()[1])
    return False


def sandbox_processes() -> list[str]:
    """The sandbox processes this test's calls left alive."""
    done = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True)
    found = []
    for line in done.stdout.splitlines():
        pid, _, args = line.strip().partition(" ")
        if ("sandbox_runner.py" in args or "-I -S code.py" in args) and descends_from_this_process(int(pid)):
            found.append(args)
    return found


def test_model_code_runs_and_writes_only_its_scratch_directory():
    result = run_python("open('notes.txt', 'w').write('6*7')\nprint(eval(open('notes.txt').read()))", LIMITS)
    assert (result.reason, result.exit_code, result.stdout) == ("ok", 0, "42\n")
    failed = run_python("raise SystemExit('bad answer')", LIMITS)
    assert (failed.reason, failed.exit_code, failed.stderr.strip()) == ("error", 1, "bad answer")


@pytest.mark.parametrize("attempt", sorted(ATTEMPTS))
def test_an_escape_attempt_ends_the_call_with_its_reason_and_leaves_the_caller_healthy(attempt, tmp_path):
    outside = tmp_path / "escaped.txt"
    code, reason, stderr = ATTEMPTS[attempt]
    started = time.monotonic()
    result = run_python(code.format(outside=str(outside)), LIMITS)
    assert result.reason == reason, result
    assert stderr in result.stderr
    assert time.monotonic() - started < LIMITS.wall_seconds + 5  # bounded: the wall time and the kill
    assert not outside.exists() and not os.path.exists("/usr/escaped")
    assert sandbox_processes() == []  # nothing it started lives on
    assert run_python("print('still here')", LIMITS).stdout == "still here\n"  # the next call runs


def test_the_code_sees_no_environment_and_no_file_of_the_run(tmp_path, monkeypatch):
    """What the run keeps secret is not there: its environment (a Redis URL with a password, the
    token file's path), the token file and a Redis append-only file, the home directory, and, when
    this runs as root, /etc/shadow; the scratch and the interpreter are all it has."""
    token = tmp_path / "token"
    token.write_text("s3cret-token")
    token.chmod(0o600)
    home = os.path.expanduser("~")
    aof = tmp_path / "redis" / "appendonly.aof"
    aof.parent.mkdir()
    aof.write_text("*2\r\n$4\r\nAUTH\r\n")
    monkeypatch.setenv("STEADYRL_INFERENCE_REDIS_URL", "redis://:pw@127.0.0.1:1/0")
    monkeypatch.setenv("STEADYRL_TOKEN_FILE", str(token))
    paths = [str(token), str(aof), "/etc/shadow", "/etc/passwd", str(tmp_path)]
    code = "\n".join(
        [
            "import os, json",
            f"found = {{p: os.path.exists(p) for p in {paths!r}}}",
            f"home = os.listdir({home!r}) if os.path.isdir({home!r}) else []",
            "seen = {'env': sorted(os.environ), 'found': found, 'root': sorted(os.listdir('/')), 'home': home}",
            "others = {}",  # every process it can see (bubblewrap's init among them): their environments
            "for pid in [p for p in os.listdir('/proc') if p.isdigit()]:",
            "    try:",
            "        others[pid] = open(f'/proc/{pid}/environ', 'rb').read().decode(errors='replace')",
            "    except OSError:",
            "        pass",
            "seen['environs'] = others",
            "print(json.dumps(seen))",
        ]
    )
    result = run_python(code, LIMITS)
    assert result.reason == "ok", result
    seen = json.loads(result.stdout)
    assert seen["env"] == ["HOME", "LANG", "PATH", "PWD", "TMPDIR"]
    assert len(seen["environs"]) >= 2  # its own and bubblewrap's were read...
    for pid, environ in seen["environs"].items():  # ...and none holds the caller's secrets
        assert "pw@" not in environ and "STEADYRL_" not in environ and str(token) not in environ, (pid, environ)
    assert not any(seen["found"].values()), seen["found"]
    prefix = os.path.realpath(sys.base_prefix)  # the interpreter's own directory may lie in the home directory
    assert all(prefix.startswith(os.path.join(home, name) + "/") for name in seen["home"]), seen["home"]
    assert set(seen["root"]) <= {
        ".steadyrl",
        "scratch",
        "dev",
        "proc",
        "etc",
        "usr",
        "bin",
        "lib",
        "lib64",
        "sbin",
        os.path.realpath(sys.base_prefix).split("/")[1],
    }


def test_metadata_outside_the_scratch_cannot_change(tmp_path):
    """chmod, utime and setxattr on the caller's files (not there) and on the interpreter's (read-only:
    a harmless one of them, in case the sandbox ever lets a change through)."""
    token = tmp_path / "token"
    token.write_text("s3cret")
    token.chmod(0o600)
    before = token.stat()
    python = os.path.join(os.path.dirname(os.__file__), "this.py")
    code = "\n".join(
        [
            "import os",
            "results = []",
            f"for path in ({str(token)!r}, {python!r}):",
            "    for name, change in (('chmod', lambda p: os.chmod(p, 0o666)),",
            "                         ('utime', lambda p: os.utime(p, (0, 0))),",
            "                         ('setxattr', lambda p: os.setxattr(p, 'user.x', b'1'))):",
            "        try:",
            "            change(path)",
            "            results.append(name + ' changed ' + path)",
            "        except OSError as exc:",
            "            results.append(name + ' ' + exc.strerror)",
            "print('\\n'.join(results))",
        ]
    )
    result = run_python(code, LIMITS)
    assert result.reason == "ok", result
    assert "changed" not in result.stdout, result.stdout
    assert result.stdout.count("No such file or directory") == 3 and result.stdout.count("Read-only file system") == 3
    after = token.stat()
    assert (stat.S_IMODE(after.st_mode), after.st_mtime_ns) == (0o600, before.st_mtime_ns)


def test_no_socket_outside_is_reachable(tmp_path):
    """A pathname unix socket the caller listens on, an abstract one, and a loopback TCP port."""
    path = tmp_path / "service.sock"
    listeners = [socket.socket(socket.AF_UNIX), socket.socket(socket.AF_UNIX), socket.socket()]
    listeners[0].bind(str(path))
    listeners[1].bind(b"\0steadyrl-test-abstract")
    listeners[2].bind(("127.0.0.1", 0))
    for listener in listeners:
        listener.listen()
        listener.setblocking(False)
    port = listeners[2].getsockname()[1]
    code = "\n".join(
        [
            "import socket",
            f"for family, address in ((socket.AF_UNIX, {str(path)!r}), (socket.AF_UNIX, b'\\0steadyrl-test-abstract'),",
            f"                        (socket.AF_INET, ('127.0.0.1', {port}))):",
            "    s = socket.socket(family)",
            "    try:",
            "        s.connect(address)",
            "        print('reached', address)",
            "    except OSError as exc:",
            "        print('unreachable:', exc.strerror)",
        ]
    )
    try:
        result = run_python(code, LIMITS)
        accepted = 0
        for listener in listeners:
            try:
                listener.accept()
                accepted += 1
            except BlockingIOError:
                pass
    finally:
        for listener in listeners:
            listener.close()
    assert result.reason == "ok", result
    assert result.stdout.count("unreachable:") == 3, result.stdout
    assert accepted == 0


def _call_cgroup_possible() -> bool:
    group = cgroups.CallGroup.make(1 << 30, 64)
    if group is None:
        return False
    group.close()
    return True


@pytest.mark.skipif(not _call_cgroup_possible(), reason="no cgroup can be made here: limits hold per process")
@pytest.mark.parametrize(
    "code",
    [
        # six children of 100 MB each: under the address-space limit each, 600 MB together
        "import os, time\nfor i in range(6):\n    if os.fork() == 0:\n        b = bytearray(100 << 20)\n"
        "        time.sleep(2)\n        os._exit(0)\ntime.sleep(3)\nprint('done')",
        # 25 memfds of 8 MB, kept open: no file over the size limit, no address space used, 200 MB
        "import os\nfds = []\nfor i in range(25):\n    fds.append(os.memfd_create('m'))\n"
        "    for _ in range(128):\n        os.write(fds[-1], b'x' * 65536)\nprint('done')",
    ],
)
def test_memory_is_limited_for_the_call_as_a_whole(code):
    limits = SandboxLimits(cpu_seconds=5, wall_seconds=8, memory_bytes=128 << 20, max_processes=16, file_bytes=8 << 20)
    result = run_python(code, limits)
    assert (result.scope, result.reason) == ("call", "memory"), result
    assert sandbox_processes() == []


def test_without_a_cgroup_the_code_is_one_process(monkeypatch):
    """Where no cgroup can be made, per-process limits are the call's only because the code cannot
    start another process or thread."""
    monkeypatch.setattr(cgroups.CallGroup, "make", classmethod(lambda cls, *a: None))
    code = (
        "import os, threading\nresults = []\ntry:\n    os.fork()\n    results.append('forked')\n"
        "except OSError as exc:\n    results.append(exc.strerror)\ntry:\n    threading.Thread(target=print).start()\n"
        "    results.append('thread')\nexcept RuntimeError as exc:\n    results.append(str(exc))\nprint(results)"
    )
    result = run_python(code, LIMITS)
    assert result.scope == "process" and result.reason == "ok", result
    assert "forked" not in result.stdout and "'thread'" not in result.stdout, result.stdout


def test_a_timeout_after_the_cpu_ran_out_is_a_cpu_limit():
    """Four processes each under the per-process CPU limit, together past it, then sleeping: the
    wall time ends the call, and its reason is the CPU it used."""
    code = (
        "import os, time\nfor i in range(4):\n    if os.fork() == 0:\n        end = time.process_time() + 0.8\n"
        "        while time.process_time() < end:\n            pass\n        time.sleep(100)\ntime.sleep(100)"
    )
    # wall time to spare: with the other cores busy (a second test worker) the four still use their
    # 3.2 CPU seconds before the wall ends the call
    limits = SandboxLimits(cpu_seconds=1, wall_seconds=8, memory_bytes=256 << 20, max_processes=8)
    result = run_python(code, limits)
    assert result.reason == "cpu_limit", result
    assert sandbox_processes() == []


def test_a_child_that_leaves_the_session_dies_with_the_call():
    """A process that setsid()s out of the call's process group still dies: the code runs in a PID
    namespace of its own."""
    result = run_python(
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(1000)\nprint('parent')", LIMITS
    )
    assert result.stdout == "parent\n"
    time.sleep(0.2)
    assert sandbox_processes() == []


def test_without_namespaces_the_call_is_refused_never_run_unconfined(tmp_path):
    """In a user namespace that may create none (max_user_namespaces 0, as a locked-down kernel or
    container leaves it), the sandbox refuses with bubblewrap's reason and runs nothing."""
    marker = tmp_path / "ran"
    script = (
        f"from shared.envs.sandbox import run_python\n"
        f"r = run_python(\"open({str(marker)!r}, 'w').write('x')\")\n"
        f"print(r.reason, '|', r.exit_code, '|', r.stderr)"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run(
        [
            "unshare",
            "-r",
            "sh",
            "-c",
            'echo 0 > /proc/sys/user/max_user_namespaces && exec "$0" -c "$1"',
            sys.executable,
            script,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=root,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    reason, exit_code, message = (part.strip() for part in done.stdout.split("|"))
    assert (reason, exit_code) == ("no_isolation", "None")
    assert message.startswith("bubblewrap could not make its namespaces") and "ENOSPC" in message
    assert not marker.exists()


PROBE = (Path(__file__).parents[1] / "syscall_probe.py").read_text()
DENIED = {name: "ENOSYS" if name == "clone3" else "EPERM" for name in NUMBERS.get(MACHINE, {})}


@pytest.mark.skipif(MACHINE not in NUMBERS, reason=f"no syscall numbers written for {MACHINE}")
@pytest.mark.parametrize("scope", ["call", "process"])
def test_every_denied_call_fails_inside_in_either_scope(scope, monkeypatch):
    """New user or network namespaces (unshare, clone with their flags, clone3, setns), keyrings, BPF,
    userfaultfd, io_uring, ptrace and perf events fail with EPERM (clone3 with ENOSYS, so libc falls back to
    clone), whether a cgroup holds the call's limits or not."""
    if scope == "call" and not _call_cgroup_possible():
        pytest.skip("no cgroup can be made here")
    if scope == "process":
        monkeypatch.setattr(cgroups.CallGroup, "make", classmethod(lambda cls, *a, **k: None))
    result = run_python(PROBE, LIMITS)
    assert (result.reason, result.scope) == ("ok", scope), result
    assert json.loads(result.stdout) == DENIED


@pytest.mark.skipif(not isolation.disables_userns(), reason="this bubblewrap has no --disable-userns")
def test_bubblewrap_alone_makes_no_user_namespace(tmp_path):
    """Without the seccomp program, bubblewrap's --disable-userns still leaves no user namespace to make."""
    code = tmp_path / "code.py"
    code.write_text(PROBE)
    argv = isolation.sandbox_argv(code, {}, 1 << 20, [isolation.interpreter(), "-I", "-S", "code.py"])
    assert "--disable-userns" in argv and "--seccomp" not in argv
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert (seen["unshare"], seen["clone"], seen["clone3"]) == ("ENOSPC", "ENOSPC", "ENOSPC"), seen


@pytest.mark.skipif(not _call_cgroup_possible(), reason="no cgroup can be made here: the code is one process")
def test_an_ordinary_program_with_threads_and_processes_still_runs():
    code = (
        "import subprocess, sys, threading\nseen = []\nthreads = [threading.Thread(target=seen.append, args=(i,))"
        " for i in range(4)]\nfor t in threads:\n    t.start()\nfor t in threads:\n    t.join()\n"
        "child = subprocess.run([sys.executable, '-I', '-S', '-c', 'print(6 * 7)'], capture_output=True, text=True)\n"
        "print(sorted(seen), child.stdout.strip())"
    )
    result = run_python(code, LIMITS)
    assert (result.reason, result.stdout) == ("ok", "[0, 1, 2, 3] 42\n"), result


def test_a_vsock_socket_to_a_vm_s_host_cannot_be_made():
    """AF_VSOCK reaches a VM's host past any network namespace: refused (EAFNOSUPPORT), other families made."""
    code = (
        "import socket\n"
        "try:\n    socket.socket(40, socket.SOCK_STREAM)\n    print('vsock made')\n"
        "except OSError as exc:\n    print('vsock', exc.errno)\n"
        "socket.socket(socket.AF_INET6).close(); socket.socket(socket.AF_UNIX).close(); print('others made')"
    )
    result = run_python(code, LIMITS)
    assert result.reason == "ok" and result.stdout.split() == ["vsock", "97", "others", "made"], result
