"""Which process holds the other end of a loopback TCP connection (Linux, /proc).

For a connection accepted on egressd's loopback listener, the client's socket is the row of
/proc/net/tcp (or tcp6) whose local address is our peer and whose remote address is our local one;
its inode names the socket, and a process holds it when one of its /proc/PID/fd links reads
`socket:[INODE]`. This module is the lookup only: the pipeline decides when it is needed
(admission/identity.py) and what an unknown owner means (a refusal wherever one is needed).

What an attacker can do, and what holds:
- PID reuse: each process is read through one open /proc/PID directory, so its fd list, exe,
  command line and status are all the same process's, or the read fails (it exited).
- A process outside the child's tree connecting: its socket is held by no descendant of the
  child, so the child-only listener refuses it; another user's /proc/PID/fd is not even readable.
- The fd passed to another process (SCM_RIGHTS) or inherited: every holder found is reported; the
  caller treats holders that disagree as an unknown owner. A descendant that keeps the socket and
  lets an outside process use it could as well relay for it: it gains nothing it did not have.
- The client gone before the lookup (connect, send, exit): no holder, an unknown owner.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from egressd.policy import IPAddress

if TYPE_CHECKING:
    from egressd.platform.diag import Diag

PROC = "/proc"
ALIAS_DIRS: tuple[str, ...] = ("/usr/local/bin", "/usr/bin", "/bin")
_MAX_TREE = 4096  # processes walked under one child before giving up (a fork bomb costs us nothing)


@dataclass(frozen=True, slots=True)
class SocketRow:
    """One row of /proc/net/tcp or tcp6."""

    local: tuple[IPAddress, int]
    remote: tuple[IPAddress, int]
    state: int
    uid: int
    inode: int


@dataclass(frozen=True, slots=True)
class Holder:
    """A process holding the socket, read through one /proc/PID directory."""

    pid: int
    exe: str | None  # readlink /proc/PID/exe (None: unreadable, e.g. a kernel thread or another user)
    cmdline: tuple[str, ...]
    ppid: int
    uid: int


@dataclass(frozen=True, slots=True)
class Peer:
    """Who holds the client's socket: every holder found, and whether each is in the child's tree."""

    inode: int
    holders: tuple[Holder, ...]
    in_tree: tuple[bool, ...]  # per holder: the child (root) or one of its descendants

    @property
    def owner(self) -> Holder | None:
        """The one program holding it, or None (no holder, or holders running different programs)."""
        exes = {h.exe for h in self.holders}
        if not self.holders or len(exes) != 1 or None in exes:
            return None
        return self.holders[0]

    @property
    def descendant(self) -> bool:
        """Every holder is the child or a descendant (and there is one)."""
        return bool(self.holders) and all(self.in_tree)


# -- /proc/net/tcp ---------------------------------------------------------------------------------
def parse_address(text: str, byteorder: str = sys.byteorder) -> tuple[IPAddress, int]:
    """`0100007F:1F90` → (127.0.0.1, 8080). The kernel prints each 32-bit word of the address in
    the host's byte order (%08X of the in-memory value) and the port as a plain number."""
    addr_hex, sep, port_hex = text.partition(":")
    if not sep or len(addr_hex) not in (8, 32) or len(port_hex) != 4:
        raise ValueError(f"not a /proc/net/tcp address: {text!r}")
    raw = bytes.fromhex(addr_hex)
    if byteorder == "little":
        raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    port = int(port_hex, 16)
    address: IPAddress = ipaddress.IPv4Address(raw) if len(raw) == 4 else ipaddress.IPv6Address(raw)
    return address, port


def parse_line(line: str, byteorder: str = sys.byteorder) -> SocketRow | None:
    """One table row; None for the header and for anything that does not read as a row."""
    fields = line.split()
    if len(fields) < 10 or not fields[0].endswith(":") or not fields[0][:-1].isdigit():
        return None
    try:
        local = parse_address(fields[1], byteorder)
        remote = parse_address(fields[2], byteorder)
        return SocketRow(local, remote, int(fields[3], 16), int(fields[7]), int(fields[9]))
    except ValueError:
        return None


def same_address(a: IPAddress, b: IPAddress) -> bool:
    """Equal, counting an IPv4-mapped IPv6 address (a dual-stack socket's view) as its IPv4 one."""
    return _unmapped(a) == _unmapped(b)


def _unmapped(address: IPAddress) -> IPAddress:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def find_row(
    lines: Iterable[str], client: tuple[IPAddress, int], server: tuple[IPAddress, int]
) -> SocketRow | None:
    """The client's socket: local address = our peer, remote = our local one, with an inode."""
    port_hex = f":{client[1]:04X} "
    for line in lines:
        if port_hex not in line:  # cheap pre-filter: only rows naming the client's port are parsed
            continue
        row = parse_line(line)
        if row is None or row.inode == 0:
            continue
        if (
            row.local[1] == client[1]
            and row.remote[1] == server[1]
            and same_address(row.local[0], client[0])
            and same_address(row.remote[0], server[0])
        ):
            return row
    return None


# -- sock_diag: the same row, asked for by its four-tuple --------------------------------------------
NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLMSG_ERROR = 2
NLM_F_REQUEST = 1
_NOCOOKIE = 0xFFFFFFFF
_ALL_STATES = 0xFFFFFFFF
_SOCKID = struct.Struct(">HH16s16s")  # ports and addresses in network order; interface, cookie follow
_NLMSG = struct.Struct("=IHHII")
_REQ = struct.Struct("=BBBBI")
_TAIL = struct.Struct("=III")  # interface, cookie[2] (host order)
_MSG_HEAD = struct.Struct("=BBBB")
_MSG_TAIL = struct.Struct("=IIIII")  # expires, rqueue, wqueue, uid, inode


def diag_request(client: tuple[IPAddress, int], server: tuple[IPAddress, int], seq: int = 1) -> bytes:
    """A SOCK_DIAG_BY_FAMILY request for the one TCP socket whose local end is `client` and remote
    end `server` (an exact lookup, not a dump of the table)."""
    family = socket.AF_INET if client[0].version == 4 else socket.AF_INET6
    sockid = _SOCKID.pack(
        client[1], server[1], client[0].packed.ljust(16, b"\0"), server[0].packed.ljust(16, b"\0")
    )
    body = (
        _REQ.pack(family, socket.IPPROTO_TCP, 0, 0, _ALL_STATES)
        + sockid
        + _TAIL.pack(0, _NOCOOKIE, _NOCOOKIE)
    )
    return _NLMSG.pack(_NLMSG.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, seq, 0) + body


def parse_diag_reply(data: bytes) -> SocketRow | None:
    """The socket of a sock_diag answer (None: an error such as ENOENT, or nothing readable)."""
    if len(data) < _NLMSG.size:
        return None
    length, kind, _, _, _ = _NLMSG.unpack_from(data)
    if kind != SOCK_DIAG_BY_FAMILY or length < _NLMSG.size + 72 or len(data) < length:
        return None
    offset = _NLMSG.size
    family, state, _, _ = _MSG_HEAD.unpack_from(data, offset)
    sport, dport, src, dst = _SOCKID.unpack_from(data, offset + 4)
    _, _, _, uid, inode = _MSG_TAIL.unpack_from(data, offset + 52)
    size = 4 if family == socket.AF_INET else 16
    cls = ipaddress.IPv4Address if size == 4 else ipaddress.IPv6Address
    return SocketRow((cls(src[:size]), sport), (cls(dst[:size]), dport), state, uid, inode)


def diag_lookup(client: tuple[IPAddress, int], server: tuple[IPAddress, int]) -> SocketRow | None:
    """The client's socket through NETLINK_SOCK_DIAG: one exact query, whatever the size of the
    table (/proc/net/tcp of a busy host holds tens of thousands of rows)."""
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as nl:
        nl.settimeout(1.0)
        nl.sendto(diag_request(client, server), (0, 0))
        reply = nl.recv(8192)
    row = parse_diag_reply(reply)
    return row if row is not None and row.inode else None


def _ask(diag: Diag, client: tuple[IPAddress, int], server: tuple[IPAddress, int]) -> SocketRow | None:
    """The client's socket through the sock_diag socket of another network namespace, shared by
    every lookup there, one question at a time."""
    with diag.lock:
        seq = diag.next_seq()
        diag.sock.settimeout(1.0)
        diag.sock.sendto(diag_request(client, server, seq), (0, 0))
        while True:  # an answer to an earlier question that timed out is skipped
            reply = diag.sock.recv(8192)
            if diag_answer(reply) == seq:
                break
    row = parse_diag_reply(reply)
    return row if row is not None and row.inode else None


def diag_answer(reply: bytes) -> int | None:
    """The sequence number of a sock_diag answer (None: too short to be one)."""
    return _NLMSG.unpack_from(reply)[3] if len(reply) >= _NLMSG.size else None


def _families(
    client: tuple[IPAddress, int], server: tuple[IPAddress, int]
) -> list[tuple[tuple[IPAddress, int], tuple[IPAddress, int]]]:
    """The four-tuple as the client's socket may hold it: a dual-stack listener sees an IPv4
    client as ::ffff:a.b.c.d, while the client's own socket is an IPv4 one."""
    out = [(client, server)]
    unmapped = (_unmapped(client[0]), client[1]), (_unmapped(server[0]), server[1])
    if unmapped != (client, server) and unmapped[0][0].version == unmapped[1][0].version:
        out.insert(0, unmapped)
    return out


def socket_inode(
    client: tuple[IPAddress, int],
    server: tuple[IPAddress, int],
    *,
    proc: str = PROC,
    diag: Diag | None = None,
) -> SocketRow | None:
    """The client's socket in this network namespace (or the one `diag` was made in): sock_diag
    when the kernel answers it, else the tables (tcp, then tcp6) of this one."""
    if diag is not None:
        try:
            return next((row for pair in _families(client, server) if (row := _ask(diag, *pair))), None)
        except OSError:
            return None
    if proc == PROC:
        try:
            for pair in _families(client, server):
                row = diag_lookup(*pair)
                if row is not None:
                    return row
            return None
        except OSError:  # no sock_diag here (an old kernel, a seccomp filter): read the tables
            pass
    for table in ("tcp", "tcp6"):
        try:
            with open(f"{proc}/net/{table}", encoding="ascii", errors="replace") as handle:
                row = find_row(handle, client, server)
        except OSError:
            continue
        if row is not None:
            return row
    return None


# -- processes -------------------------------------------------------------------------------------
def children(pid: int, *, proc: str = PROC) -> list[int]:
    """The children of every thread of pid (/proc/PID/task/TID/children)."""
    out: list[int] = []
    try:
        tids = os.listdir(f"{proc}/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"{proc}/{pid}/task/{tid}/children", encoding="ascii") as handle:
                out += [int(p) for p in handle.read().split()]
        except (OSError, ValueError):
            continue
    return out


def tree(root: int, *, proc: str = PROC) -> list[int]:
    """root and its descendants, breadth first (a snapshot; bounded)."""
    seen = [root]
    queue = [root]
    known = {root}
    while queue and len(seen) < _MAX_TREE:
        for child in children(queue.pop(0), proc=proc):
            if child not in known:
                known.add(child)
                seen.append(child)
                queue.append(child)
    return seen


def all_pids(*, proc: str = PROC) -> Iterator[int]:
    try:
        names = os.listdir(proc)
    except OSError:
        return
    for name in names:
        if name.isdigit():
            yield int(name)


def _holder(pid: int, link: str, *, proc: str) -> Holder | None:
    """pid, if it holds the socket `link` (socket:[INODE]); every read through one directory fd."""
    try:
        dirfd = os.open(f"{proc}/{pid}", os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        fdfd = os.open("fd", os.O_RDONLY | os.O_DIRECTORY, dir_fd=dirfd)
        try:
            names = os.listdir(fdfd)
            found = False
            for name in names:
                try:
                    if os.readlink(name, dir_fd=fdfd) == link:
                        found = True
                        break
                except OSError:
                    continue
        finally:
            os.close(fdfd)
        if not found:
            return None
        return _read_process(pid, dirfd)
    except OSError:
        return None  # exited meanwhile, or not ours to read
    finally:
        os.close(dirfd)


def _read_process(pid: int, dirfd: int) -> Holder | None:
    try:
        exe: str | None = os.readlink("exe", dir_fd=dirfd)
    except OSError:
        exe = None
    with open(os.open("cmdline", os.O_RDONLY, dir_fd=dirfd), "rb") as handle:
        raw = handle.read(64 * 1024)
    cmdline = tuple(part.decode("utf-8", "replace") for part in raw.split(b"\0") if part)
    ppid = uid = -1
    with open(os.open("status", os.O_RDONLY, dir_fd=dirfd), encoding="utf-8", errors="replace") as handle:
        for line in handle:
            if line.startswith("PPid:"):
                ppid = int(line.split()[1])
            elif line.startswith("Uid:"):
                uid = int(line.split()[1])
                break
    return Holder(pid, exe, cmdline, ppid, uid)


def in_tree(holder: Holder, tree_pids: frozenset[int], root: int) -> bool:
    """holder is root, or a descendant whose parent (read with it, through its own /proc directory)
    is in the tree found a moment before: a pid reused meanwhile by a process outside the tree has a
    parent outside it, and a process whose parent exited was re-parented out of the tree."""
    return holder.pid == root or (holder.pid in tree_pids and holder.ppid in tree_pids)


def lookup(
    client: tuple[IPAddress, int],
    server: tuple[IPAddress, int],
    root: int | None = None,
    *,
    tree_only: bool = False,
    proc: str = PROC,
    diag: Diag | None = None,
) -> Peer | None:
    """Who holds the client's end of the connection client → server (None: no such socket), in
    this network namespace or the one `diag` asks.

    The child's tree (root and its descendants) is searched first; without a holder there, and
    unless `tree_only`, every process this user may read."""
    row = socket_inode(client, server, proc=proc, diag=diag)
    if row is None:
        return None
    link = f"socket:[{row.inode}]"
    candidates: list[int] = tree(root, proc=proc) if root is not None else []
    holders = [h for pid in candidates if (h := _holder(pid, link, proc=proc)) is not None]
    if not holders and not tree_only:
        searched = set(candidates)
        me = os.getpid()
        for pid in all_pids(proc=proc):
            if pid in searched or pid == me:
                continue
            found = _holder(pid, link, proc=proc)
            if found is not None:
                holders.append(found)
    tree_pids = frozenset(candidates)
    marks = tuple(root is not None and in_tree(h, tree_pids, root) for h in holders)
    return Peer(row.inode, tuple(holders), marks)


@lru_cache(maxsize=256)
def aliases(exe: str) -> frozenset[str]:
    """The executable's path and the symlinks to it in its own directory and the system's bin
    directories (`/usr/bin/python3` → python3.11, `/usr/bin/node` → nodejs): the names a user
    knows the program by. Cached per executable for the life of the process."""
    found = {exe}
    real = os.path.realpath(exe)
    for directory in dict.fromkeys((os.path.dirname(exe), *ALIAS_DIRS)):
        try:
            entries = list(os.scandir(directory))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.is_symlink() and os.path.realpath(entry.path) == real:
                    found.add(entry.path)
            except OSError:
                continue
    return frozenset(found)
