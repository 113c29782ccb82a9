"""The owner lookup's parsing of /proc/net/tcp and tcp6: byte order, IPv6 words, v4-mapped
addresses, the row that is the client's (not egressd's own end), and rows that do not read."""

from __future__ import annotations

import ipaddress
import os
import socket
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from egressd.platform import peer

ip = ipaddress.ip_address
HEADER = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode"


def format_address(
    address: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int, byteorder: str = sys.byteorder
) -> str:
    """The inverse of parse_address: how the kernel prints this address and port."""
    raw = address.packed
    if byteorder == "little":
        raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return f"{raw.hex().upper()}:{port:04X}"


def row(local: str, remote: str, *, state: str = "01", uid: int = 1000, inode: int = 4242) -> str:
    return (
        f"   0: {local} {remote} {state} 00000000:00000000 00:00000000 00000000  {uid}        0 {inode} "
        "1 0000000000000000 20 4 30 10 -1"
    )


@pytest.mark.parametrize(
    ("text", "byteorder", "address", "port"),
    [
        ("0100007F:1F90", "little", "127.0.0.1", 8080),  # what x86 and arm64 print
        ("7F000001:1F90", "big", "127.0.0.1", 8080),  # what s390x prints
        ("0100007F:0050", "little", "127.0.0.1", 80),
        ("00000000:0000", "little", "0.0.0.0", 0),
        ("0101A8C0:FFFF", "little", "192.168.1.1", 65535),
        ("0201007F:C350", "little", "127.0.1.2", 50000),  # byte order within the word, not the port
        ("00000000000000000000000001000000:01BB", "little", "::1", 443),
        ("00000000000000000000000000000001:01BB", "big", "::1", 443),
        ("0000000000000000FFFF00000100007F:1F90", "little", "::ffff:127.0.0.1", 8080),  # v4-mapped
        ("B80D0120000000000000000001000000:0016", "little", "2001:db8::1", 22),
    ],
)
def test_addresses_in_either_byte_order(text: str, byteorder: str, address: str, port: int) -> None:
    assert peer.parse_address(text, byteorder) == (ip(address), port)
    assert format_address(ip(address), port, byteorder) == text


@pytest.mark.parametrize(
    "text",
    [
        "",
        "0100007F",
        "0100007F:",
        "0100007F:1F9",
        "0100007F:1F900",
        "100007F:1F90",
        "0100007G:1F90",
        "0100007F:XYZW",
        "0000000000000000000000000100000:01BB",
        "0100007F1F90",
    ],
)
def test_addresses_that_do_not_read_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        peer.parse_address(text)


@pytest.mark.parametrize(
    "line",
    [
        HEADER,
        "",
        "garbage",
        "   0: 0100007F:1F90",
        "   x: 0100007F:1F90 0100007F:C350 01 0 0 0 1000 0 4242",
        row("0100007F:1F90", "nonsense"),
        "   0: " + " ".join(["0100007F:1F90"] * 2) + " 01 a b c d notanumber 0 1",
    ],
)
def test_lines_that_are_not_rows(line: str) -> None:
    assert peer.parse_line(line, "little") is None


def test_a_row_reads_state_uid_and_inode() -> None:
    parsed = peer.parse_line(row("0100007F:C350", "0100007F:1F90", uid=1234, inode=99), "little")
    assert parsed == peer.SocketRow((ip("127.0.0.1"), 50000), (ip("127.0.0.1"), 8080), 1, 1234, 99)


def _find(lines: list[str], client: tuple[str, int], server: tuple[str, int]) -> peer.SocketRow | None:
    return peer.find_row(lines, (ip(client[0]), client[1]), (ip(server[0]), server[1]))


def test_the_clients_row_not_egressds_own_end() -> None:
    client, server = ("127.0.0.1", 50000), ("127.0.0.1", 8080)
    lines = [
        HEADER,
        row(format_address(ip("127.0.0.1"), 8080), "00000000:0000", state="0A", inode=1),  # listener
        row(format_address(ip("127.0.0.1"), 8080), format_address(ip("127.0.0.1"), 50000), inode=2),
        row(format_address(ip("127.0.0.1"), 50000), format_address(ip("127.0.0.1"), 8080), inode=3),
    ]
    found = _find(lines, client, server)
    assert found is not None and found.inode == 3


def test_same_port_other_address_or_no_inode_is_not_the_client() -> None:
    client, server = ("127.0.0.1", 50000), ("127.0.0.1", 8080)
    other = row(format_address(ip("127.0.0.2"), 50000), format_address(ip("127.0.0.1"), 8080), inode=7)
    other_server = row(format_address(ip("127.0.0.1"), 50000), format_address(ip("127.0.0.1"), 8081))
    timewait = row(format_address(ip("127.0.0.1"), 50000), format_address(ip("127.0.0.1"), 8080), inode=0)
    assert _find([other, other_server, timewait], client, server) is None


def test_a_v4_mapped_view_matches_the_ipv4_row() -> None:
    """A dual-stack listener sees ::ffff:127.0.0.1; the client's socket is in the IPv4 table."""
    line = row(format_address(ip("127.0.0.1"), 50000), format_address(ip("127.0.0.1"), 8080), inode=5)
    found = _find([line], ("::ffff:127.0.0.1", 50000), ("::ffff:127.0.0.1", 8080))
    assert found is not None and found.inode == 5
    v6 = row(format_address(ip("::1"), 50000), format_address(ip("::1"), 8080), inode=6)
    found = _find([v6], ("::1", 50000), ("::1", 8080))
    assert found is not None and found.inode == 6
    assert _find([v6], ("127.0.0.1", 50000), ("127.0.0.1", 8080)) is None  # ::1 is not 127.0.0.1


addresses = st.one_of(
    st.integers(0, 2**32 - 1).map(ipaddress.IPv4Address),
    st.integers(0, 2**128 - 1).map(ipaddress.IPv6Address),
)
ports = st.integers(0, 65535)


@given(addresses, ports, addresses, ports, st.integers(1, 2**40), st.sampled_from(["little", "big"]))
def test_property_rows_round_trip_and_are_found(
    local: ipaddress.IPv4Address | ipaddress.IPv6Address,
    lport: int,
    remote: ipaddress.IPv4Address | ipaddress.IPv6Address,
    rport: int,
    inode: int,
    byteorder: str,
) -> None:
    line = row(
        format_address(local, lport, byteorder),
        format_address(remote, rport, byteorder),
        inode=inode,
    )
    parsed = peer.parse_line(line, byteorder)
    assert parsed is not None
    assert parsed.local == (local, lport) and parsed.remote == (remote, rport) and parsed.inode == inode
    if byteorder == peer.sys.byteorder:
        found = peer.find_row([HEADER, line], (local, lport), (remote, rport))
        assert found is not None and found.inode == inode


@given(st.text(max_size=200))
def test_property_any_line_parses_or_is_skipped(line: str) -> None:
    parsed = peer.parse_line(line)
    assert parsed is None or isinstance(parsed, peer.SocketRow)


# -- the live lookup, on this machine's /proc ------------------------------------------------------
def test_this_process_holds_its_own_connection() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
        with client, accepted:
            found = peer.lookup(
                (ip(client.getsockname()[0]), client.getsockname()[1]),
                (ip(accepted.getsockname()[0]), accepted.getsockname()[1]),
                os.getpid(),
                tree_only=True,
            )
            assert found is not None and found.descendant
            # the lookup skips the calling process only outside the tree: here it is the tree
            assert [h.pid for h in found.holders] == [os.getpid()]
            assert found.owner is not None and found.owner.exe == os.readlink("/proc/self/exe")


def test_a_closed_client_has_no_owner() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
        ends = ((ip("127.0.0.1"), client.getsockname()[1]), (ip("127.0.0.1"), accepted.getsockname()[1]))
        client.close()
        with accepted:
            found = peer.lookup(*ends, os.getpid())
            assert found is None or not found.holders


def test_aliases_name_the_symlinks_to_an_executable(tmp_path: os.PathLike[str]) -> None:
    real = os.path.realpath("/usr/bin/python3")
    assert "/usr/bin/python3" in peer.aliases(real)
