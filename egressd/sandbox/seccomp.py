"""The sandbox's seccomp filter: a classic BPF program bubblewrap loads (`--seccomp FD`) before it
starts the launcher, so the launcher and every process of the child run under it.

What it refuses, and why (everything else is allowed: the namespaces and the mounts confine the
rest):

- `socket` and `socketpair` with a family other than AF_UNIX, AF_INET, AF_INET6 and AF_NETLINK:
  EAFNOSUPPORT, as from a kernel built without that family. AF_VSOCK shares the virtual machine's
  vsock space with the host (Firecracker, Kata, WSL2, QEMU) and is no network namespace's to
  confine; AF_PACKET, AF_BLUETOOTH, AF_ALG, AF_CAN... are nothing a tool behind a proxy needs.
- `io_uring_setup`, `io_uring_enter` and `io_uring_register`: ENOSYS (programs fall back to plain
  system calls). io_uring opens sockets without the `socket` call (IORING_OP_SOCKET), out of any
  filter's sight.
- `keyctl`, `add_key` and `request_key`: ENOSYS, as from a kernel without keyrings (Kerberos
  libraries fall back to file caches). The user's keyrings hold Kerberos, AFS and CIFS credentials.
  One call passes: `keyctl(KEYCTL_JOIN_SESSION_KEYRING, NULL)`, which replaces the caller's session
  keyring with a new, empty, anonymous one; the launcher makes it before it starts the child, so the
  child does not even hold the user's session keyring for the kernel's own look-ups.
- every system call of another ABI: ENOSYS, as from a kernel built without it. The i386 entry
  (`int 0x80`, open to any x86-64 process) and the x32 one number their calls differently; a filter
  that checked only the native numbers would let `socket(AF_VSOCK)` through them.

Pure: the program is built here (and table-tested through a BPF interpreter in the tests); only
`write_to` touches a descriptor. Plain classes, no dataclasses nor typing: the launcher imports
this, and starts fast.
"""

from __future__ import annotations

import errno
import functools
import os
import struct

# linux/audit.h
AUDIT_ARCH_X86_64 = 0xC000003E
AUDIT_ARCH_AARCH64 = 0xC00000B7
X32_SYSCALL_BIT = 0x40000000
# linux/seccomp.h
RET_ALLOW = 0x7FFF0000
RET_ERRNO = 0x00050000
# struct seccomp_data: nr (u32), arch (u32), instruction_pointer (u64), args (u64[6])
OFFSET_NR = 0
OFFSET_ARCH = 4
OFFSET_ARGS = 16
# linux/filter.h opcodes
_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JGE_K = 0x35
_RET_K = 0x06

ALLOWED_FAMILIES = {
    "AF_UNIX": 1,
    "AF_INET": 2,
    "AF_INET6": 10,
    "AF_NETLINK": 16,
}
KEYCTL_JOIN_SESSION_KEYRING = 1
IO_URING_CALLS = ("io_uring_setup", "io_uring_enter", "io_uring_register")


class Arch:
    """One native ABI: its audit number, its system call numbers, whether it has an x32 twin."""

    __slots__ = ("audit", "calls", "name", "x32")

    def __init__(self, name: str, audit: int, calls: dict[str, int], x32: bool = False) -> None:
        self.name = name
        self.audit = audit
        self.calls = calls
        self.x32 = x32


ARCHES = {
    "x86_64": Arch(
        "x86_64",
        AUDIT_ARCH_X86_64,
        {
            "socket": 41,
            "socketpair": 53,
            "add_key": 248,
            "request_key": 249,
            "keyctl": 250,
            "io_uring_setup": 425,
            "io_uring_enter": 426,
            "io_uring_register": 427,
        },
        x32=True,
    ),
    "aarch64": Arch(
        "aarch64",
        AUDIT_ARCH_AARCH64,
        {
            "socket": 198,
            "socketpair": 199,
            "add_key": 217,
            "request_key": 218,
            "keyctl": 219,
            "io_uring_setup": 425,
            "io_uring_enter": 426,
            "io_uring_register": 427,
        },
    ),
}
ARCH_ALIASES = {"amd64": "x86_64", "arm64": "aarch64"}


def native_arch(machine: str | None = None) -> Arch | None:
    """The running machine's ABI, or None where egressd has no filter for it."""
    machine = (machine or os.uname().machine).lower()
    return ARCHES.get(ARCH_ALIASES.get(machine, machine))


def _arg(index: int, high: bool = False) -> int:
    """Offset of one 32-bit half of a system call argument (little-endian: the low half first)."""
    return OFFSET_ARGS + 8 * index + (4 if high else 0)


class Ld:
    __slots__ = ("offset",)

    def __init__(self, offset: int) -> None:
        self.offset = offset  # into struct seccomp_data


class Jump:
    __slots__ = ("k", "op", "otherwise", "then")

    def __init__(self, op: int, k: int, then: str | None = None, otherwise: str | None = None) -> None:
        self.op = op  # _JEQ_K or _JGE_K
        self.k = k
        self.then = then  # a label; None: the next instruction
        self.otherwise = otherwise


class Ret:
    __slots__ = ("value",)

    def __init__(self, value: int) -> None:
        self.value = value


class Label:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


Instruction = Ld | Jump | Ret | Label


def _jeq(k: int, then: str | None = None, otherwise: str | None = None) -> Jump:
    return Jump(_JEQ_K, k, then, otherwise)


def _source(arch: Arch) -> list[Instruction]:
    calls = arch.calls
    program: list[Instruction] = [
        Ld(OFFSET_ARCH),
        _jeq(arch.audit, otherwise="enosys"),
        Ld(OFFSET_NR),
    ]
    if arch.x32:
        program.append(Jump(_JGE_K, X32_SYSCALL_BIT, "enosys"))
    program += [
        _jeq(calls["socket"], "family"),
        _jeq(calls["socketpair"], "family"),
        _jeq(calls["keyctl"], "keyctl"),
        _jeq(calls["add_key"], "enosys"),
        _jeq(calls["request_key"], "enosys"),
        *(_jeq(calls[name], "enosys") for name in IO_URING_CALLS),
        Ret(RET_ALLOW),
        Label("family"),
        Ld(_arg(0)),  # an int: the kernel reads the low half only
        *(_jeq(family, "allow") for family in ALLOWED_FAMILIES.values()),
        Ret(RET_ERRNO | errno.EAFNOSUPPORT),
        Label("keyctl"),
        Ld(_arg(0)),
        _jeq(KEYCTL_JOIN_SESSION_KEYRING, otherwise="enosys"),
        Ld(_arg(1)),  # the name: a pointer, NULL in both halves
        _jeq(0, otherwise="enosys"),
        Ld(_arg(1, high=True)),
        _jeq(0, "allow", "enosys"),
        Label("enosys"),
        Ret(RET_ERRNO | errno.ENOSYS),
        Label("allow"),
        Ret(RET_ALLOW),
    ]
    return program


def assemble(source: list[Instruction]) -> list[tuple[int, int, int, int]]:
    """Labels to forward jump offsets; (code, jt, jf, k) per instruction."""
    positions: dict[str, int] = {}
    count = 0
    for item in source:
        if isinstance(item, Label):
            positions[item.name] = count
        else:
            count += 1
    out: list[tuple[int, int, int, int]] = []
    for item in source:
        if isinstance(item, Ld):
            out.append((_LD_W_ABS, 0, 0, item.offset))
        elif isinstance(item, Ret):
            out.append((_RET_K, 0, 0, item.value))
        elif isinstance(item, Jump):
            here = len(out)
            jumps = []
            for target in (item.then, item.otherwise):
                offset = 0 if target is None else positions[target] - here - 1
                if not 0 <= offset <= 255:
                    raise ValueError(f"jump to {target!r} out of range")
                jumps.append(offset)
            out.append((item.op, jumps[0], jumps[1], item.k))
    return out


@functools.cache
def program(machine: str | None = None) -> bytes | None:
    """The filter as bubblewrap reads it (struct sock_filter[], native byte order), or None where
    egressd has no filter for this machine."""
    arch = native_arch(machine)
    if arch is None:
        return None
    return b"".join(struct.pack("=HBBI", *insn) for insn in assemble(_source(arch)))


def write_to(data: bytes) -> int:
    """A pipe's read end holding `data`, closed for writing: bubblewrap reads it to EOF."""
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, data)  # a few hundred bytes: far below a pipe's buffer
    finally:
        os.close(write_end)
    return read_end
