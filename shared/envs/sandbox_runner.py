"""The inside of `shared.envs.sandbox`: run as `python -I sandbox_runner.py CONFIG_JSON` (standard
library only), it isolates itself, then runs the model's code as PID 1 of a namespace of its own.

1. New user, network and PID namespaces (unshare): no network but a loopback that is down, and
   every process the code starts dies with it. Refused (exit 3, the reason on stdout) where the
   kernel does not allow them, never run without.
2. Landlock: the code can write only under its scratch directory (reads stay allowed).
3. No capabilities, no new privileges; rlimits: CPU seconds, address space, processes (counted
   in its own user namespace), file size (its output files too), open files, no core dumps.
The code's stdout and stderr go to files in the scratch directory (bounded by the file-size limit).
"""

import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWUSER, CLONE_NEWNET, CLONE_NEWPID = 0x10000000, 0x40000000, 0x20000000
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF, SYS_CAPSET = 444, 445, 446, 126
# LANDLOCK_ACCESS_FS_*: every right that changes the file system (ABI 1..3), and truncate (ABI >= 3)
WRITE_RIGHTS = (1 << 1) | (1 << 4) | (1 << 5) | (1 << 6) | (1 << 7) | (1 << 8) | (1 << 9) | (1 << 10) | (1 << 11) \
    | (1 << 12)
REFER, TRUNCATE = 1 << 13, 1 << 14
REFUSED = 3

libc = ctypes.CDLL(None, use_errno=True)


def refuse(reason: str) -> None:
    print(json.dumps({"refused": reason}), flush=True)
    os._exit(REFUSED)


def check(result: int, what: str) -> None:
    if result < 0:
        refuse(f"{what}: {os.strerror(ctypes.get_errno())}")


def isolate() -> None:
    uid, gid = os.getuid(), os.getgid()
    check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID), "user, network and PID namespaces")
    for path, text in (("/proc/self/setgroups", "deny"), ("/proc/self/uid_map", f"1000 {uid} 1"),
                       ("/proc/self/gid_map", f"1000 {gid} 1")):
        with open(path, "w") as f:
            f.write(text)


class RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64)]


class PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def confine_writes(scratch: str) -> None:
    abi = libc.syscall(SYS_LANDLOCK_CREATE_RULESET, None, 0, 1)
    check(abi, "Landlock (file writes outside the scratch directory)")
    rights = WRITE_RIGHTS | (REFER if abi >= 2 else 0) | (TRUNCATE if abi >= 3 else 0)
    attr = RulesetAttr(rights)
    ruleset = libc.syscall(SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.sizeof(attr), 0)
    check(ruleset, "Landlock ruleset")
    fd = os.open(scratch, os.O_PATH | os.O_DIRECTORY)
    rule = PathBeneath(rights, fd)
    check(libc.syscall(SYS_LANDLOCK_ADD_RULE, ruleset, 1, ctypes.byref(rule), 0), "Landlock rule")
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    check(libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0), "Landlock restrict")
    os.close(fd)
    os.close(ruleset)


def drop_capabilities() -> None:
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable × 2 words: none
    check(libc.syscall(SYS_CAPSET, header, data), "dropping capabilities")


def limit(config: dict) -> None:
    cpu = int(config["cpu_seconds"])
    for name, value in ((resource.RLIMIT_CPU, (cpu, cpu + 1)), (resource.RLIMIT_AS, config["memory_bytes"]),
                        (resource.RLIMIT_NPROC, config["max_processes"]), (resource.RLIMIT_FSIZE, config["file_bytes"]),
                        (resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(name, value if isinstance(value, tuple) else (value, value))


def main() -> None:
    config = json.loads(sys.argv[1])
    scratch = config["scratch"]
    isolate()
    child = os.fork()  # PID 1 of the new PID namespace: every process it starts dies with it
    if child == 0:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        os.chdir(scratch)
        confine_writes(scratch)
        drop_capabilities()
        out = os.open(os.path.join(scratch, ".stdout"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        err = os.open(os.path.join(scratch, ".stderr"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(out, 1)
        os.dup2(err, 2)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        limit(config)
        os.execv(sys.executable, [sys.executable, "-I", "-S", "code.py"])
    print(json.dumps({"child": child}), flush=True)  # the caller waits for it to be gone after a kill
    _, status = os.waitpid(child, 0)
    code = os.waitstatus_to_exitcode(status)
    print(json.dumps({"exit": code}), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
