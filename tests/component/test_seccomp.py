"""The sandbox's seccomp filter, run through a classic-BPF interpreter: every system call the child
could make to get a socket family, a keyring or another ABI, against what the filter must answer.

The interpreter executes the exact bytes bubblewrap loads (struct sock_filter[]), so a wrong jump
offset or a swapped half of an argument shows here, not only in the kernel (the end-to-end side is
tests/security/test_sandbox_syscalls.py).
"""

from __future__ import annotations

import errno
import os
import socket
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from egressd.sandbox import seccomp
from egressd.sandbox.bwrap import BwrapSpec, bwrap_argv

ALLOW = "allow"
AUDIT_ARCH_I386 = 0x40000003
AUDIT_ARCH_ARM = 0x40000028


def run_filter(program: bytes, nr: int, arch: int, args: tuple[int, ...] = ()) -> str | int:
    """Classic BPF as the kernel runs a seccomp filter: 'allow', or the errno it returns."""
    args = (*args, *(0,) * (6 - len(args)))
    data = struct.pack("=IIQ6Q", nr, arch, 0, *args)
    insns = [struct.unpack("=HBBI", program[i : i + 8]) for i in range(0, len(program), 8)]
    acc, pc = 0, 0
    for _ in range(len(insns)):  # jumps go forward only: at most one pass
        code, jt, jf, k = insns[pc]
        if code == 0x20:  # BPF_LD | BPF_W | BPF_ABS
            assert k % 4 == 0 and k + 4 <= len(data), k
            acc = struct.unpack_from("=I", data, k)[0]
            pc += 1
        elif code in (0x15, 0x35):  # BPF_JMP | BPF_JEQ / BPF_JGE | BPF_K
            taken = acc == k if code == 0x15 else acc >= k
            pc += 1 + (jt if taken else jf)
        elif code == 0x06:  # BPF_RET | BPF_K
            if k == seccomp.RET_ALLOW:
                return ALLOW
            assert k & 0xFFFF0000 == seccomp.RET_ERRNO, hex(k)
            return k & 0xFFFF
        else:
            raise AssertionError(f"unexpected opcode {code:#x}")
    raise AssertionError("ran off the end of the program")


X86 = seccomp.ARCHES["x86_64"]
ARM = seccomp.ARCHES["aarch64"]
PROGRAMS = {arch.name: seccomp.program(arch.name) for arch in (X86, ARM)}
KEYCTL_JOIN = seccomp.KEYCTL_JOIN_SESSION_KEYRING
KEYCTL_READ = 11
KEYCTL_GET_KEYRING_ID = 0
KEY_SPEC_SESSION_KEYRING = -3 & 0xFFFFFFFFFFFFFFFF
AF_VSOCK = 40
AF_PACKET = 17


def call(arch: seccomp.Arch, name: str) -> int:
    return arch.calls[name]


# (what, arch, syscall number or name, args, answer)
CASES = [
    # the four families, both ways of making a socket
    ("unix socket", "socket", (socket.AF_UNIX, socket.SOCK_STREAM), ALLOW),
    ("inet socket", "socket", (socket.AF_INET, socket.SOCK_STREAM), ALLOW),
    ("inet6 socket", "socket", (socket.AF_INET6, socket.SOCK_DGRAM), ALLOW),
    ("netlink socket", "socket", (socket.AF_NETLINK, socket.SOCK_RAW), ALLOW),
    ("unix socketpair", "socketpair", (socket.AF_UNIX, socket.SOCK_STREAM), ALLOW),
    # every other family refused
    ("vsock", "socket", (AF_VSOCK, socket.SOCK_STREAM), errno.EAFNOSUPPORT),
    ("vsock socketpair", "socketpair", (AF_VSOCK, socket.SOCK_STREAM), errno.EAFNOSUPPORT),
    ("packet", "socket", (AF_PACKET, socket.SOCK_RAW), errno.EAFNOSUPPORT),
    ("bluetooth", "socket", (31, socket.SOCK_STREAM), errno.EAFNOSUPPORT),
    ("alg", "socket", (38, socket.SOCK_SEQPACKET), errno.EAFNOSUPPORT),
    ("AF_UNSPEC", "socket", (0, socket.SOCK_STREAM), errno.EAFNOSUPPORT),
    ("family 255", "socket", (255, socket.SOCK_STREAM), errno.EAFNOSUPPORT),
    # the kernel reads the family as an int: high bits set on an allowed family are still that
    # family to the kernel, and to the filter; high bits on vsock are still vsock
    ("inet, high half set", "socket", ((1 << 32) | socket.AF_INET, 1), ALLOW),
    ("vsock, high half set", "socket", ((1 << 32) | AF_VSOCK, 1), errno.EAFNOSUPPORT),
    ("vsock as a negative int", "socket", (AF_VSOCK - (1 << 32), 1), errno.EAFNOSUPPORT),
    # keyrings: refused, but for a fresh anonymous session keyring
    ("keyctl read", "keyctl", (KEYCTL_READ, 1234, 0, 0), errno.ENOSYS),
    ("keyctl session id", "keyctl", (KEYCTL_GET_KEYRING_ID, KEY_SPEC_SESSION_KEYRING), errno.ENOSYS),
    ("keyctl join, NULL name", "keyctl", (KEYCTL_JOIN, 0), ALLOW),
    ("keyctl join a named keyring", "keyctl", (KEYCTL_JOIN, 0x7FFF0000), errno.ENOSYS),
    ("keyctl join, name in the high half", "keyctl", (KEYCTL_JOIN, 1 << 32), errno.ENOSYS),
    ("keyctl join, high bits on the option", "keyctl", ((1 << 32) | KEYCTL_JOIN, 0), ALLOW),
    ("keyctl read, option 11 with high bits", "keyctl", ((1 << 32) | KEYCTL_READ, 1), errno.ENOSYS),
    ("add_key", "add_key", (0, 0, 0, 0, KEY_SPEC_SESSION_KEYRING), errno.ENOSYS),
    ("request_key", "request_key", (0, 0, 0, 0), errno.ENOSYS),
    # io_uring makes sockets no filter sees
    ("io_uring_setup", "io_uring_setup", (8, 0), errno.ENOSYS),
    ("io_uring_enter", "io_uring_enter", (3, 1), errno.ENOSYS),
    ("io_uring_register", "io_uring_register", (3, 0), errno.ENOSYS),
    # what a tool does all day passes
    ("read", 0, (0, 0, 0), ALLOW),
    ("connect", 42, (3, 0, 16), ALLOW),
    ("clone3", 435, (0, 0), ALLOW),
    ("ptrace", 101, (16, 2), ALLOW),  # the child's own tree; PID 1 is the launcher, not dumpable
]


@pytest.mark.parametrize(("what", "name", "args", "expected"), CASES, ids=[c[0] for c in CASES])
def test_x86_64_native_calls(what: str, name: str | int, args: tuple[int, ...], expected: str | int) -> None:
    nr = name if isinstance(name, int) else call(X86, name)
    masked = tuple(a & 0xFFFFFFFFFFFFFFFF for a in args)
    assert run_filter(PROGRAMS["x86_64"], nr, X86.audit, masked) == expected


@pytest.mark.parametrize(
    ("what", "name", "args", "expected"),
    [c for c in CASES if not isinstance(c[1], int)],
    ids=[c[0] for c in CASES if not isinstance(c[1], int)],
)
def test_aarch64_native_calls(what: str, name: str, args: tuple[int, ...], expected: str | int) -> None:
    masked = tuple(a & 0xFFFFFFFFFFFFFFFF for a in args)
    assert run_filter(PROGRAMS["aarch64"], call(ARM, name), ARM.audit, masked) == expected


@pytest.mark.parametrize(
    ("what", "program", "nr", "arch"),
    [
        # i386 through int 0x80: socket is 359, socketcall 102, keyctl 288, getpid 20
        ("i386 socket(AF_VSOCK)", "x86_64", 359, AUDIT_ARCH_I386),
        ("i386 socketcall", "x86_64", 102, AUDIT_ARCH_I386),
        ("i386 keyctl", "x86_64", 288, AUDIT_ARCH_I386),
        ("i386 getpid", "x86_64", 20, AUDIT_ARCH_I386),
        # i386 numbers that are x86-64's socket and keyctl: the arch decides, not the number
        ("i386 call 41", "x86_64", 41, AUDIT_ARCH_I386),
        ("i386 call 250", "x86_64", 250, AUDIT_ARCH_I386),
        # x32: x86-64's audit arch, numbers with bit 30 set
        ("x32 socket", "x86_64", seccomp.X32_SYSCALL_BIT | 41, X86.audit),
        ("x32 keyctl", "x86_64", seccomp.X32_SYSCALL_BIT | 250, X86.audit),
        ("x32 getpid", "x86_64", seccomp.X32_SYSCALL_BIT | 39, X86.audit),
        ("x32 past the bit", "x86_64", 0xFFFFFFFF, X86.audit),
        # 32-bit ARM under arm64
        ("arm socket", "aarch64", 281, AUDIT_ARCH_ARM),
        ("arm call 198", "aarch64", 198, AUDIT_ARCH_ARM),
        # an arch the filter was not built for
        ("aarch64 numbers on the x86-64 filter", "x86_64", 198, ARM.audit),
    ],
)
def test_every_other_abi_is_refused(what: str, program: str, nr: int, arch: int) -> None:
    assert run_filter(PROGRAMS[program], nr, arch, (AF_VSOCK, 1)) == errno.ENOSYS


def reference(arch: seccomp.Arch, nr: int, audit: int, args: tuple[int, ...]) -> str | int:
    """What the filter must answer, written the obvious way."""
    if audit != arch.audit or (arch.x32 and nr >= seccomp.X32_SYSCALL_BIT):
        return errno.ENOSYS
    by_number = {number: name for name, number in arch.calls.items()}
    name = by_number.get(nr)
    if name in ("socket", "socketpair"):
        allowed = args[0] & 0xFFFFFFFF in seccomp.ALLOWED_FAMILIES.values()
        return ALLOW if allowed else errno.EAFNOSUPPORT
    if name == "keyctl":
        return ALLOW if args[0] & 0xFFFFFFFF == KEYCTL_JOIN and args[1] == 0 else errno.ENOSYS
    if name is not None:
        return errno.ENOSYS
    return ALLOW


U64 = st.integers(min_value=0, max_value=2**64 - 1)


@settings(max_examples=400, deadline=None)
@given(
    arch=st.sampled_from([X86, ARM]),
    nr=st.one_of(
        st.sampled_from(sorted({*X86.calls.values(), *ARM.calls.values(), 359, 102, 288})),
        st.integers(min_value=0, max_value=2**32 - 1),
        st.integers(min_value=0, max_value=500).map(lambda n: n | seccomp.X32_SYSCALL_BIT),
    ),
    audit=st.sampled_from([X86.audit, ARM.audit, AUDIT_ARCH_I386, AUDIT_ARCH_ARM]),
    family=st.one_of(st.sampled_from([0, 1, 2, 10, 16, 17, 40, 1 << 32 | 2]), U64),
    second=st.one_of(st.just(0), st.just(1 << 32), U64),
)
def test_the_filter_answers_as_the_reference(
    arch: seccomp.Arch, nr: int, audit: int, family: int, second: int
) -> None:
    args = (family, second)
    assert run_filter(PROGRAMS[arch.name], nr, audit, args) == reference(arch, nr, audit, args)


def test_no_filter_for_a_machine_without_one() -> None:
    assert seccomp.program("riscv64") is None
    assert seccomp.native_arch("amd64") == X86 and seccomp.native_arch("arm64") == ARM


def test_a_jump_too_far_is_refused() -> None:
    source: list[seccomp.Instruction] = [seccomp.Jump(0x15, 0, "far")]
    source += [seccomp.Ret(seccomp.RET_ALLOW)] * 256 + [seccomp.Label("far"), seccomp.Ret(0)]
    with pytest.raises(ValueError, match="out of range"):
        seccomp.assemble(source)


def test_bubblewrap_reads_the_filter_from_the_descriptor() -> None:
    argv = bwrap_argv(BwrapSpec("bwrap", "/w", (), ("true",), seccomp_fd=7))
    assert argv[argv.index("--seccomp") + 1] == "7"
    assert "--as-pid-1" in argv
    data = PROGRAMS["x86_64"]
    assert data is not None
    fd = seccomp.write_to(data)
    try:
        assert os.read(fd, 4096) == data and os.read(fd, 1) == b""  # all of it, then EOF
    finally:
        os.close(fd)
