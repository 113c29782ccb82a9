"""The identity step's parts on their own: the sock_diag request and answer, the once-per-connection
lookup, the child-only listener's credentials rule, and pid/exe in the audit and `egressd watch`."""

from __future__ import annotations

import io
import ipaddress
import json
import os
import socket
import struct
from collections.abc import Iterator

import pytest

from egressd.admission import identity
from egressd.admission.credentials import CredentialStore, authenticate
from egressd.admission.events import Decided, Told
from egressd.admission.state import ConnState
from egressd.cli.watch import _line
from egressd.front.tunnel import listener_end
from egressd.observe.audit import AuditLog
from egressd.platform import peer

ip = ipaddress.ip_address


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
        with client, accepted:
            yield client, accepted


def _ends(client: socket.socket, accepted: socket.socket) -> tuple[tuple[str, int], tuple[str, int]]:
    return client.getsockname()[:2], accepted.getsockname()[:2]


def test_the_diag_request_names_the_clients_four_tuple() -> None:
    request = peer.diag_request((ip("127.0.0.1"), 50000), (ip("127.0.0.2"), 8080), seq=7)
    length, kind, flags, seq, _ = struct.unpack_from("=IHHII", request)
    assert (length, kind, flags, seq) == (len(request), 20, 1, 7)
    family, protocol = request[16], request[17]
    assert (family, protocol) == (socket.AF_INET, socket.IPPROTO_TCP)
    sport, dport, src, dst = struct.unpack_from(">HH16s16s", request, 24)
    assert (sport, dport) == (50000, 8080)  # network byte order on the wire
    assert src[:4] == bytes([127, 0, 0, 1]) and dst[:4] == bytes([127, 0, 0, 2])
    v6 = peer.diag_request((ip("::1"), 1), (ip("::1"), 2))
    assert v6[16] == socket.AF_INET6 and v6[28:44] == ip("::1").packed


@pytest.mark.parametrize(
    "reply", [b"", b"\0" * 15, struct.pack("=IHHII", 36, 2, 0, 1, 0) + b"\xfe\xff\xff\xff" + b"\0" * 16]
)
def test_errors_and_short_answers_are_no_socket(reply: bytes) -> None:
    assert peer.parse_diag_reply(reply) is None  # NLMSG_ERROR (ENOENT) or truncated


def test_the_kernel_names_the_same_inode_as_fstat(pair: tuple[socket.socket, socket.socket]) -> None:
    client, accepted = pair
    (chost, cport), (shost, sport) = _ends(client, accepted)
    inode = os.fstat(client.fileno()).st_ino
    row = peer.diag_lookup((ip(chost), cport), (ip(shost), sport))
    assert row is not None and row.inode == inode and row.local == (ip(chost), cport)
    # the tables say the same (the fallback), and a dual-stack view of it finds it too
    table = peer.socket_inode((ip(chost), cport), (ip(shost), sport), proc="/proc/.")
    assert table is not None and table.inode == inode
    mapped = peer.socket_inode((ip(f"::ffff:{chost}"), cport), (ip(f"::ffff:{shost}"), sport))
    assert mapped is not None and mapped.inode == inode
    assert peer.diag_lookup((ip(chost), cport), (ip(shost), sport + 1 if sport < 65535 else 1)) is None


def test_identify_once_per_connection(pair: tuple[socket.socket, socket.socket]) -> None:
    conn = ConnState("c1", "peer", ends=_ends(*pair))
    found = identity.identify(conn, os.getpid(), tree_only=True)
    assert found.pid == os.getpid() and found.in_tree and found.program is not None
    assert found.exe == os.readlink("/proc/self/exe")
    assert identity.identify(conn, None) is found  # cached: looked up once
    assert identity.identify(ConnState("c2", "peer"), os.getpid()) == identity.UNKNOWN


def test_a_listeners_bound_address_is_the_local_end_of_what_it_accepts() -> None:
    """listener_end: the front takes a connection's local end from its listener when the listener
    is bound to one address; a wildcard or a non-IP listener leaves it to each connection."""
    for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
        try:
            server = socket.create_server((host, 0), family=family)
        except OSError:
            continue  # no IPv6 here
        with server, socket.create_connection(server.getsockname()[:2]) as client:
            accepted, _ = server.accept()
            with accepted:
                assert listener_end(server) == accepted.getsockname()[:2] == client.getpeername()[:2]
    with socket.create_server(("0.0.0.0", 0)) as wildcard:
        assert listener_end(wildcard) is None
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as unix:
        assert listener_end(unix) is None


def test_outside_the_tree_is_not_the_childs(pair: tuple[socket.socket, socket.socket]) -> None:
    """Searched only in a tree that does not hold the socket (our parent's pid is not ours)."""
    conn = ConnState("c1", "peer", ends=_ends(*pair))
    found = identity.identify(conn, 2**22 - 7, tree_only=True)  # no such process
    assert found.pid is None and not found.in_tree and "none of the child" in found.why


def test_child_only_listener_credentials() -> None:
    store = CredentialStore()
    creds = store.issue()
    conn = ConnState("c1", "peer", implicit=creds, tree_only=True)
    assert not authenticate(store, conn, None)  # not looked up: not the child's
    conn.identity = identity.Identity(pid=5, exe="/usr/bin/curl", in_tree=False)
    assert not authenticate(store, conn, None)
    conn.identity = identity.Identity(pid=5, exe="/usr/bin/curl", in_tree=True)
    assert authenticate(store, conn, None) and conn.creds == creds
    store.revoke(creds)
    assert not authenticate(store, conn, None)  # revoked: nothing more


def _decided(**extra: object) -> Decided:
    return Decided(
        "c1", "egressd", None, "request", "up.test", 80, True, "allowlist", "allow: up.test", "", **extra
    )  # type: ignore[arg-type]


def test_the_audit_and_watch_name_the_program(tmp_path: os.PathLike[str]) -> None:
    path = os.path.join(tmp_path, "audit.jsonl")
    trace = io.StringIO()
    with AuditLog(path, trace=trace) as log:
        log.observe(_decided(pid=4242, exe="/usr/bin/curl"))
        log.observe(_decided())
    with open(path) as handle:
        first, second = (json.loads(line) for line in handle)
    assert (first["pid"], first["exe"]) == (4242, "/usr/bin/curl")
    assert "pid" not in second and "exe" not in second  # not looked up
    assert "[curl pid 4242]" in trace.getvalue().splitlines()[0]
    line = _line(
        {
            "event": "decision",
            "stage": "request",
            "host": "up.test",
            "port": 80,
            "allowed": True,
            "reason": "allowlist",
            "rule": "allow: up.test",
            "pid": 4242,
            "exe": "/usr/bin/curl",
        },
        Told(),
    )
    assert line is not None and line.endswith("[/usr/bin/curl pid 4242]")
