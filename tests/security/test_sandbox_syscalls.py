"""A sandboxed child that has read the source tries the kernel's other doors: socket families no
network namespace confines (AF_VSOCK reaches the hypervisor), the user's keyrings, another system
call ABI to get past the filter, io_uring, and ptrace of what is not its own.

Everything runs through the real `egressd sandbox` with real bubblewrap; each attempt prints what
the kernel answered, and the test fails if any door is open.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.egressd_cli import EGRESSD
from tests.support.sandboxes import egressd_sandbox, python_inside, sandbox_env

ATTEMPTS = """
    import ctypes, errno, json, os, socket
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    out = {}
    def code(exc):
        return errno.errorcode.get(exc.errno, str(exc.errno))
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    out["Seccomp"] = status["Seccomp"].strip()
    families = {
        "AF_VSOCK": (40, socket.SOCK_STREAM), "AF_PACKET": (17, socket.SOCK_RAW),
        "AF_BLUETOOTH": (31, socket.SOCK_STREAM), "AF_ALG": (38, socket.SOCK_SEQPACKET),
        "AF_UNIX": (1, socket.SOCK_STREAM), "AF_INET": (2, socket.SOCK_STREAM),
        "AF_INET6": (10, socket.SOCK_STREAM), "AF_NETLINK": (16, socket.SOCK_DGRAM),
    }
    for name, (family, kind) in families.items():
        try:
            socket.socket(family, kind).close()
            out[name] = "opened"
        except OSError as exc:
            out[name] = code(exc)
    try:
        socket.socketpair(40, socket.SOCK_STREAM)
        out["socketpair AF_VSOCK"] = "opened"
    except OSError as exc:
        out["socketpair AF_VSOCK"] = code(exc)
    def syscall(nr, *args):
        result = libc.syscall(ctypes.c_long(nr), *(ctypes.c_long(a) for a in args))
        return result if result >= 0 else errno.errorcode.get(ctypes.get_errno())
    keyctl, add_key, request_key, io_uring_setup = json.loads(os.environ["CALLS"])
    out["keyctl session id"] = syscall(keyctl, 0, -3, 0)          # KEYCTL_GET_KEYRING_ID
    out["keyctl read"] = syscall(keyctl, 11, -3, 0, 0)            # KEYCTL_READ
    out["add_key"] = syscall(add_key, 0, 0, 0, 0, -3)
    out["request_key"] = syscall(request_key, 0, 0, 0, 0)
    name = ctypes.create_string_buffer(b"_ses")
    out["keyctl join a named keyring"] = syscall(keyctl, 1, ctypes.addressof(name))
    out["keyctl join a new keyring"] = "ok" if isinstance(syscall(keyctl, 1, 0), int) else "refused"
    params = ctypes.create_string_buffer(120)
    out["io_uring_setup"] = syscall(io_uring_setup, 4, ctypes.addressof(params))
    print(json.dumps(out))
"""


def _calls() -> str:
    from egressd.sandbox import seccomp

    arch = seccomp.native_arch()
    assert arch is not None, f"no seccomp filter for {os.uname().machine}"
    return json.dumps([arch.calls[n] for n in ("keyctl", "add_key", "request_key", "io_uring_setup")])


def test_socket_families_keyrings_and_io_uring_are_refused(work: Path) -> None:
    env = sandbox_env(work)
    env["CALLS"] = _calls()
    result = egressd_sandbox([], python_inside(ATTEMPTS), cwd=work, env=env)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    assert seen["Seccomp"] == "2"  # a filter, in every process of the sandbox
    for family in ("AF_VSOCK", "AF_PACKET", "AF_BLUETOOTH", "AF_ALG", "socketpair AF_VSOCK"):
        assert seen[family] == "EAFNOSUPPORT", (family, seen)
    for family in ("AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"):
        assert seen[family] == "opened", (family, seen)
    for call in ("keyctl session id", "keyctl read", "add_key", "request_key", "keyctl join a named keyring"):
        assert seen[call] == "ENOSYS", (call, seen)
    assert seen["keyctl join a new keyring"] == "ok"  # an empty keyring of its own: nothing to read
    assert seen["io_uring_setup"] == "ENOSYS"  # io_uring would open sockets past the filter


# int 0x80 (the i386 entry) and the x32 one, from a 64-bit process: machine code run in place.
# i386: socket(AF_VSOCK, SOCK_STREAM, 0) is call 359, getpid 20; x32: getpid is 39 | bit 30.
OTHER_ABIS = """
    import ctypes, json, mmap
    def run(code):
        page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
        page.write(bytes.fromhex(code))
        address = ctypes.addressof(ctypes.c_char.from_buffer(page))
        return ctypes.c_int(ctypes.CFUNCTYPE(ctypes.c_long)(address)()).value
    # push rbx; mov eax, NR; mov ebx, 40; mov ecx, 1; xor edx, edx; int 0x80; pop rbx; ret
    i386 = "53 b8 {nr} bb 28000000 b9 01000000 31d2 cd80 5b c3"
    out = {
        "i386 getpid": run(i386.format(nr="14000000").replace(" ", "")),
        "i386 socket(AF_VSOCK)": run(i386.format(nr="67010000").replace(" ", "")),
        # mov eax, 0x40000027; syscall; ret
        "x32 getpid": run("b827000040" "0f05" "c3"),
    }
    print(json.dumps(out))
"""
ENOSYS = -errno.ENOSYS


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="machine code for x86-64's i386 and x32 entries")
def test_another_abi_gets_nothing_past_the_filter(work: Path) -> None:
    """Outside the sandbox the i386 entry answers (this kernel runs i386 code: getpid is a PID);
    inside, every call through another ABI fails as on a kernel built without it."""
    outside = subprocess.run(
        python_inside(OTHER_ABIS), capture_output=True, text=True, timeout=60, check=True
    )
    assert json.loads(outside.stdout)["i386 getpid"] > 0, "this kernel has no i386 entry to try"
    result = egressd_sandbox([], python_inside(OTHER_ABIS), cwd=work)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {
        "i386 getpid": ENOSYS,
        "i386 socket(AF_VSOCK)": ENOSYS,
        "x32 getpid": ENOSYS,
    }


PTRACE = """
    import ctypes, errno, json, os
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.restype = ctypes.c_long
    others = sorted(int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid())
    out = {"pid": os.getpid(), "others": others}
    for pid in others:
        seen = {}
        result = libc.ptrace(0x4206, pid, 0, 0)  # PTRACE_SEIZE: no stop, nothing to undo
        seen["ptrace"] = "attached" if result == 0 else errno.errorcode.get(ctypes.get_errno())
        for path in (f"/proc/{pid}/mem", f"/proc/{pid}/environ"):
            try:
                with open(path, "rb") as f:
                    f.read(1)
                seen[path.rsplit("/", 1)[1]] = "read"
            except OSError as exc:
                seen[path.rsplit("/", 1)[1]] = errno.errorcode.get(exc.errno)
        seen["fd"] = "EACCES"
        try:  # root's child may list the names; no process of the child may open one
            for name in os.listdir(f"/proc/{pid}/fd"):
                try:
                    os.close(os.open(f"/proc/{pid}/fd/{name}", os.O_RDONLY))
                    seen["fd"] = "opened"
                except OSError as exc:
                    seen["fd"] = errno.errorcode.get(exc.errno)
        except OSError as exc:
            seen["fd"] = errno.errorcode.get(exc.errno)
        buf = ctypes.create_string_buffer(8)
        local = (ctypes.c_void_p * 2)(ctypes.addressof(buf), 8)
        remote = (ctypes.c_void_p * 2)(0x400000, 8)
        libc.process_vm_readv.restype = ctypes.c_long
        n = libc.process_vm_readv(pid, local, 1, remote, 1, 0)
        seen["process_vm_readv"] = errno.errorcode.get(ctypes.get_errno()) if n < 0 else "read"
        out[str(pid)] = seen
    print(json.dumps(out))
"""


def test_nothing_outside_the_childs_tree_can_be_traced(work: Path) -> None:
    """The only process in the sandbox that is not the child's is its first one, the launcher (no
    bubblewrap init stays inside): it cannot be traced, read or written."""
    result = egressd_sandbox([], python_inside(PTRACE), cwd=work)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    assert seen["others"] == [1], seen  # only the launcher, PID 1
    assert seen["1"]["ptrace"] == "EPERM", seen
    assert seen["1"]["mem"] in ("EACCES", "EPERM") and seen["1"]["environ"] in ("EACCES", "EPERM"), seen
    assert seen["1"]["fd"] in ("EACCES", "EPERM"), seen
    assert seen["1"]["process_vm_readv"] == "EPERM", seen


ORPHANS = """
    import os, time
    for _ in range(5):
        child = os.fork()
        if child == 0:  # a child that leaves a grandchild behind, which exits at once
            if os.fork() == 0:
                os._exit(0)
            os._exit(0)
        os.waitpid(child, 0)  # its own child it reaps; the grandchild is an orphan
    deadline = time.monotonic() + 20
    while True:
        zombies = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
                    zombies.append(pid)
            except OSError:
                pass
        if not zombies or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    print(len(zombies))
"""


def test_orphans_the_child_leaves_are_reaped(work: Path) -> None:
    """The launcher is the sandbox's PID 1: what the child leaves behind becomes its to reap."""
    result = egressd_sandbox([], python_inside(ORPHANS), cwd=work)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == b"0"


# A key the user holds in the session keyring egressd is started from, which only its possessors
# may see (permissions 0x3f000000: possessor all, user nothing): /proc/keys lists it to a process
# only when that process's keyrings lead to it.
KEYS = """
    import ctypes, os, sys
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    keyctl, add_key = int(sys.argv[1]), int(sys.argv[2])
    def check(result):
        if result < 0:
            raise OSError(ctypes.get_errno(), "keyctl")
        return result
    check(libc.syscall(ctypes.c_long(keyctl), ctypes.c_long(1), ctypes.c_char_p(sys.argv[3].encode())))
    key = check(libc.syscall(ctypes.c_long(add_key), b"user", sys.argv[4].encode(), b"kerberos-ticket",
                             ctypes.c_size_t(15), ctypes.c_long(-3)))
    possessor_only = ctypes.c_long(0x3F000000)
    check(libc.syscall(ctypes.c_long(keyctl), ctypes.c_long(5), ctypes.c_long(key), possessor_only))
    os.execvp(sys.argv[5], sys.argv[5:])
"""


def test_the_users_session_keyring_stays_outside(tmp_path: Path, work: Path) -> None:
    from egressd.sandbox import seccomp

    arch = seccomp.native_arch()
    assert arch is not None
    description = f"egressd-key-{os.getpid()}-{tmp_path.name}"
    ring = f"egressd-ring-{os.getpid()}-{tmp_path.name}"
    read_keys = ["sh", "-c", f"grep -c {description} /proc/keys || true"]
    here = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(KEYS), str(arch.calls["keyctl"]), str(arch.calls["add_key"]),
         ring, description, *read_keys],
        capture_output=True, timeout=60,
    )  # fmt: skip
    assert here.stdout.strip() == b"1", here  # its possessor sees it
    inside = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(KEYS), str(arch.calls["keyctl"]), str(arch.calls["add_key"]),
         ring, description, *EGRESSD, "sandbox", "--", *read_keys],
        cwd=work, env=sandbox_env(work), capture_output=True, timeout=60,
    )  # fmt: skip
    assert inside.returncode == 0, inside.stderr
    assert inside.stdout.strip() == b"0", inside  # the sandbox's session keyring is a new one
