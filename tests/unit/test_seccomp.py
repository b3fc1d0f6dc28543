"""The sandboxes' seccomp programs, run by a classic-BPF interpreter written here, for both architectures (so
aarch64's program is checked on any machine): each denied call fails with its errno whatever the arguments, clone
and unshare only with a namespace flag, other calls and other arguments run, and another ABI's calls fail. The
syscall numbers are tests/syscall_probe.py's, written apart from shared/envs/seccomp.py's."""

import errno
import struct

import pytest

from shared.envs import seccomp
from tests.syscall_probe import NUMBERS

ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
ALLOW = "allow"


def run(program: bytes, arch: int, nr: int, arg0: int = 0) -> str | int:
    """What the program returns for one call: "allow", or the errno it fails with."""
    data = struct.pack("<iIQ6Q", nr, arch, 0, arg0, 0, 0, 0, 0, 0)
    ops = [struct.unpack("=HBBI", program[i : i + 8]) for i in range(0, len(program), 8)]
    pc, acc = 0, 0
    while True:
        code, jt, jf, k = ops[pc]
        if code == 0x20:  # ld [k]
            acc = struct.unpack_from("<I", data, k)[0]
            pc += 1
        elif code == 0x06:  # ret k
            assert k == 0x7FFF0000 or k >> 16 == 0x0005, hex(k)
            return ALLOW if k == 0x7FFF0000 else k & 0xFFFF
        else:
            taken = {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
            pc += 1 + (jt if taken else jf)


@pytest.mark.parametrize("machine", sorted(ARCH))
def test_the_deny_list_fails_each_denied_call_and_runs_the_rest(machine):
    program = seccomp.program(seccomp.DENIED, machine)
    numbers = NUMBERS[machine]
    arch = ARCH[machine]
    for name, number in numbers.items():
        expected = errno.ENOSYS if name == "clone3" else errno.EPERM
        if name in ("clone", "unshare"):
            assert run(program, arch, number, 0x10000000 | 17) == expected, name  # CLONE_NEWUSER
            assert run(program, arch, number, 0x40000000) == expected, name  # CLONE_NEWNET
            assert run(program, arch, number, 0x00020000) == expected, name  # CLONE_NEWNS
            assert run(program, arch, number, 0x003D0F00 | 17) == ALLOW, name  # a thread's flags, or fork's
        else:
            assert run(program, arch, number, 0) == run(program, arch, number, 0xFFFFFFFF) == expected, name
    assert run(program, arch, numbers["unshare"], 0x80) == errno.EPERM  # CLONE_NEWTIME
    others = {0, 1, 3, 9, 39, 59, 60, 202, 231, 500} - set(numbers.values())  # read, write, exit, futex, ...
    assert {run(program, arch, nr) for nr in others} == {ALLOW}
    assert run(program, 0x40000003, 0) == errno.ENOSYS  # another ABI: i386 or arm32
    if machine == "x86_64":
        assert run(program, arch, 0x40000000 | 56) == errno.ENOSYS  # x32's clone


@pytest.mark.parametrize("machine", sorted(ARCH))
def test_one_process_also_fails_every_fork_and_clone(machine):
    program = seccomp.program(seccomp.ONE_PROCESS, machine)
    numbers = {**NUMBERS[machine], **({"fork": 57, "vfork": 58} if machine == "x86_64" else {})}
    assert run(program, ARCH[machine], numbers["clone"], 0x003D0F00) == errno.EAGAIN  # a thread
    assert run(program, ARCH[machine], numbers["clone"], 0x10000000) == errno.EPERM  # a user namespace
    assert run(program, ARCH[machine], numbers["clone3"]) == errno.ENOSYS  # then libc's clone: EAGAIN
    for name in ("fork", "vfork"):
        if name in numbers:
            assert run(program, ARCH[machine], numbers[name]) == errno.EAGAIN


def test_an_unknown_architecture_has_no_program():
    assert seccomp.program(seccomp.DENIED, "riscv64") is None


@pytest.mark.parametrize("machine", sorted(ARCH))
def test_a_vsock_socket_is_refused_and_every_other_family_made(machine):
    """AF_VSOCK reaches a VM's host past any network namespace; the families a program uses stay."""
    program = seccomp.program(seccomp.DENIED, machine)
    socket_nr = {"x86_64": 41, "aarch64": 198}[machine]
    assert run(program, ARCH[machine], socket_nr, 40) == errno.EAFNOSUPPORT  # AF_VSOCK
    for family in (1, 2, 10, 16, 41, 8):  # unix, inet, inet6, netlink, and neighbours of 40 in bits
        assert run(program, ARCH[machine], socket_nr, family) == ALLOW, family
