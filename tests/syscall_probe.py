"""Run inside a sandbox (standard library only, `python -I -S`): try every system call the sandboxes deny and print
one JSON object, call → the errno name it failed with, or "ran". Its numbers come from the kernel's unistd headers,
written here again so that a wrong number in shared/envs/seccomp.py is caught rather than repeated. Each call is
made so that, allowed, it does something harmless (a child made by clone exits at once); unshare, which would move
the probe itself into new namespaces, comes last."""

import ctypes
import errno
import json
import os
import platform

NUMBERS = {
    "x86_64": {
        "clone": 56,
        "clone3": 435,
        "setns": 308,
        "keyctl": 250,
        "add_key": 248,
        "request_key": 249,
        "bpf": 321,
        "userfaultfd": 323,
        "io_uring_setup": 425,
        "io_uring_enter": 426,
        "io_uring_register": 427,
        "ptrace": 101,
        "perf_event_open": 298,
        "unshare": 272,
    },
    "aarch64": {
        "clone": 220,
        "clone3": 435,
        "setns": 268,
        "keyctl": 219,
        "add_key": 217,
        "request_key": 218,
        "bpf": 280,
        "userfaultfd": 282,
        "io_uring_setup": 425,
        "io_uring_enter": 426,
        "io_uring_register": 427,
        "ptrace": 117,
        "perf_event_open": 241,
        "unshare": 97,
    },
}
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
SIGCHLD = 17


def main() -> dict[str, str]:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    numbers = NUMBERS[platform.machine()]
    buffer = ctypes.create_string_buffer(256)  # zeroed: io_uring_params, perf_event_attr, clone_args
    clone_args = ctypes.create_string_buffer(
        (CLONE_NEWUSER | CLONE_NEWNET).to_bytes(8, "little") + bytes(24) + SIGCHLD.to_bytes(8, "little") + bytes(24)
    )
    attempts = {
        "clone": (CLONE_NEWUSER | CLONE_NEWNET | SIGCHLD, 0, 0, 0, 0),
        "clone3": (ctypes.addressof(clone_args), 64),
        "setns": (-1, CLONE_NEWUSER),
        "keyctl": (0, -3, 0),  # KEYCTL_GET_KEYRING_ID of the session keyring
        "add_key": (b"user", b"steadyrl-probe", b"x", 1, -2),
        "request_key": (b"user", b"steadyrl-probe", None, -2),
        "bpf": (0, ctypes.addressof(buffer), 72),  # BPF_MAP_CREATE with zeroed attributes
        "userfaultfd": (0,),
        "io_uring_setup": (1, ctypes.addressof(buffer)),
        "io_uring_enter": (-1, 0, 0, 0, None, 0),
        "io_uring_register": (-1, 0, None, 0),
        "ptrace": (16, 999_999, 0, 0),  # PTRACE_ATTACH to no process
        "perf_event_open": (ctypes.addressof(buffer), 0, -1, -1, 0),
        "unshare": (CLONE_NEWUSER | CLONE_NEWNET,),
    }
    out = {}
    for name, args in attempts.items():
        ctypes.set_errno(0)
        result = libc.syscall(
            ctypes.c_long(numbers[name]), *[ctypes.c_long(a) if isinstance(a, int) else a for a in args]
        )
        if result == 0 and name in ("clone", "clone3"):
            os._exit(0)  # the child of a clone that ran
        if result > 0 and name in ("clone", "clone3"):
            os.waitpid(result, 0)
        out[name] = "ran" if result >= 0 else errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))
    return out


if __name__ == "__main__":
    print(json.dumps(main()))
