"""The code sandbox for real (user, network and PID namespaces, Landlock, rlimits on this kernel):
each escape attempt ends its call with a reason, and the calling process stays healthy."""

import os
import subprocess
import sys
import time

import pytest

from shared.envs.sandbox import SandboxLimits, run_python

LIMITS = SandboxLimits(cpu_seconds=1, wall_seconds=4, memory_bytes=256 << 20, max_processes=8, file_bytes=1 << 16)

ATTEMPTS = {
    "network": ("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)", "error",
                "Network is unreachable"),
    "write_outside": ("open({outside!r}, 'w').write('x')", "error", "Permission denied"),
    "fork_bomb": ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", "timeout", ""),
    "infinite_loop": ("while True:\n    pass", "cpu_limit", ""),
    "sleep_forever": ("import time\ntime.sleep(1000)", "timeout", ""),
    "memory_bomb": ("x = []\nwhile True:\n    x.append(bytearray(10**7))", "memory", "MemoryError"),
    "output_flood": ("while True:\n    print('x' * 1000)", "output_limit", "File too large"),
}


def sandbox_processes() -> list[str]:
    done = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True)
    return [line for line in done.stdout.splitlines() if "sandbox_runner.py" in line or "-I -S code.py" in line]


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
    assert not outside.exists()
    assert sandbox_processes() == []  # nothing it started lives on
    assert run_python("print('still here')", LIMITS).stdout == "still here\n"  # the next call runs
    assert os.getpid() and len(os.sched_getaffinity(0)) >= 1  # the caller itself is untouched


def test_a_child_that_leaves_the_session_dies_with_the_call():
    """A process that setsid()s out of the call's process group still dies: the code is PID 1 of its
    own PID namespace."""
    result = run_python("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(1000)\nprint('parent')",
                        LIMITS)
    assert result.stdout == "parent\n"
    time.sleep(0.2)
    assert sandbox_processes() == []


def test_without_namespaces_the_call_is_refused_never_run_unconfined(tmp_path):
    """In a user namespace that may create none (max_user_namespaces 0, as a locked-down kernel or
    container leaves it), the sandbox refuses with the kernel's reason and runs nothing."""
    marker = tmp_path / "ran"
    script = (f"from shared.envs.sandbox import run_python\n"
              f"r = run_python(\"open({str(marker)!r}, 'w').write('x')\")\n"
              f"print(r.reason, '|', r.exit_code, '|', r.stderr)")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run(["unshare", "-r", "sh", "-c", "echo 0 > /proc/sys/user/max_user_namespaces && exec \"$0\" -c "
                           "\"$1\"", sys.executable, script], capture_output=True, text=True, timeout=60, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "no_isolation | None | user, network and PID namespaces: No space left on device"
    assert not marker.exists()
