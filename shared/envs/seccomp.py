"""The seccomp programs of both sandboxes, in classic BPF as bubblewrap's `--seccomp FD` reads them: a deny-list of
the calls an untrusted program has no use for and the kernel's attack surface is in (new namespaces, keyrings, BPF,
userfaultfd, io_uring, ptrace, perf events), and, for code kept to one process, every call that makes a process or
thread. Only the architectures whose syscall numbers are written below are known: elsewhere `program` returns None
and the sandboxes refuse to run (docs/security.md).

Details: docs/internals/inference.md"""

from __future__ import annotations

import errno
import os
import platform
import struct
from dataclasses import dataclass

# (audit arch, syscall numbers) per architecture, from the kernel's unistd headers (arm64: asm-generic)
ARCHES = {
    "x86_64": (
        0xC000003E,
        {
            "clone": 56,
            "fork": 57,
            "vfork": 58,
            "ptrace": 101,
            "add_key": 248,
            "request_key": 249,
            "keyctl": 250,
            "unshare": 272,
            "perf_event_open": 298,
            "setns": 308,
            "bpf": 321,
            "userfaultfd": 323,
            "io_uring_setup": 425,
            "io_uring_enter": 426,
            "io_uring_register": 427,
            "clone3": 435,
            "socket": 41,
        },
    ),
    "aarch64": (
        0xC00000B7,
        {
            "unshare": 97,
            "ptrace": 117,
            "add_key": 217,
            "request_key": 218,
            "keyctl": 219,
            "clone": 220,
            "perf_event_open": 241,
            "setns": 268,
            "bpf": 280,
            "userfaultfd": 282,
            "io_uring_setup": 425,
            "io_uring_enter": 426,
            "io_uring_register": 427,
            "clone3": 435,
            "socket": 198,
        },
    ),
}
X32 = 0x40000000  # x86_64's x32 ABI: its numbers carry this bit
# CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET; unshare also takes CLONE_NEWTIME (0x80),
# which in clone's first argument is part of the exit signal
NAMESPACES = 0x7E020000
CLONE_NEWTIME = 0x80
AF_VSOCK = 40  # a VM's socket to its hypervisor: no network namespace holds it


@dataclass(frozen=True)
class Deny:
    """A call failed with `errno`; with `flags`, only when its first argument holds one of them; with `equals`,
    only when its first argument is that value (else it fails with `otherwise`, or runs when that is None)."""

    errno: int
    flags: int = 0
    otherwise: int | None = None
    equals: int | None = None


DENIED = {
    "unshare": Deny(errno.EPERM, NAMESPACES | CLONE_NEWTIME),
    "clone": Deny(errno.EPERM, NAMESPACES),
    "clone3": Deny(errno.ENOSYS),  # its flags sit in memory seccomp cannot read: libc then falls back to clone
    "setns": Deny(errno.EPERM),
    "socket": Deny(errno.EAFNOSUPPORT, equals=AF_VSOCK),  # the host past the VM, outside any namespace
    **{
        name: Deny(errno.EPERM)
        for name in (
            "keyctl",
            "add_key",
            "request_key",
            "bpf",
            "userfaultfd",
            "io_uring_setup",
            "io_uring_enter",
            "io_uring_register",
            "ptrace",
            "perf_event_open",
        )
    },
}
ONE_PROCESS = {
    **DENIED,
    "clone": Deny(errno.EPERM, NAMESPACES, otherwise=errno.EAGAIN),
    "fork": Deny(errno.EAGAIN),
    "vfork": Deny(errno.EAGAIN),
}

_LD_W_ABS, _JEQ_K, _JGE_K, _JSET_K, _RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
_ALLOW = 0x7FFF0000
_NR, _ARCH, _ARG0 = 0, 4, 16  # offsets in struct seccomp_data (the first argument's low half: little-endian)


def _fail(number: int) -> int:
    return 0x00050000 | number  # SECCOMP_RET_ERRNO


def program(rules: dict[str, Deny], machine: str | None = None) -> bytes | None:
    """The BPF program applying `rules` (syscall name → Deny; names this architecture lacks are skipped); any
    other call runs. Calls of another ABI (i386 from x86_64, x32, arm32) fail with ENOSYS. None for an
    architecture not in ARCHES."""
    known = ARCHES.get(machine or platform.machine())
    if known is None:
        return None
    arch, numbers = known
    ops = [(_LD_W_ABS, 0, 0, _ARCH), (_JEQ_K, 1, 0, arch), (_RET_K, 0, 0, _fail(errno.ENOSYS)), (_LD_W_ABS, 0, 0, _NR)]
    if arch == ARCHES["x86_64"][0]:
        ops += [(_JGE_K, 0, 1, X32), (_RET_K, 0, 0, _fail(errno.ENOSYS))]
    for name, deny in rules.items():
        if name not in numbers:
            continue
        if not deny.flags and deny.equals is None:
            ops += [(_JEQ_K, 0, 1, numbers[name]), (_RET_K, 0, 0, _fail(deny.errno))]
            continue
        otherwise = _ALLOW if deny.otherwise is None else _fail(deny.otherwise)
        test = (_JSET_K, 0, 1, deny.flags) if deny.equals is None else (_JEQ_K, 0, 1, deny.equals)
        ops += [
            (_JEQ_K, 0, 4, numbers[name]),
            (_LD_W_ABS, 0, 0, _ARG0),
            test,
            (_RET_K, 0, 0, _fail(deny.errno)),
            (_RET_K, 0, 0, otherwise),
        ]
    ops.append((_RET_K, 0, 0, _ALLOW))
    return b"".join(struct.pack("=HBBI", *op) for op in ops)


def unknown() -> str | None:
    """Why no seccomp program can be made here (None when one can)."""
    if platform.machine() in ARCHES:
        return None
    return f"no seccomp program is known for {platform.machine()} (known: {', '.join(ARCHES)})"


def program_fd(rules: dict[str, Deny]) -> int:
    """A file descriptor (a memfd, close-on-exec: pass it on with pass_fds) holding the program of `rules`, read
    from its start by bubblewrap's `--seccomp FD`; OSError on an unknown architecture."""
    code = program(rules)
    if code is None:
        raise OSError(unknown())
    fd = os.memfd_create("steadyrl-seccomp")
    os.write(fd, code)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
