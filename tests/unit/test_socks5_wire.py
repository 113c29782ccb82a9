"""egressd.wire.socks5: the SOCKS5 server handshake read sans-I/O, strictly and at a bounded cost.

Why: the SOCKS5 front decides on what this parser returns. A parser that reads a message one way
when it arrives whole and another way when it arrives in pieces, that holds unbounded bytes, or that
crashes on bytes a client may send, is a way past (or a way to stall) the admission pipeline.
"""

from __future__ import annotations

import contextlib
import ipaddress
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from egressd.wire.socks5 import (
    MAX_MESSAGE,
    NO_ACCEPTABLE,
    NO_AUTH,
    USER_PASS,
    Credentials,
    Event,
    Greeting,
    Reply,
    Request,
    Socks5Error,
    Socks5Server,
    TunnelData,
    auth_reply,
    reply,
)

GREETING = b"\x05\x01\x02"
AUTH = b"\x01\x04user\x05token"


def request(host: bytes, port: int = 443, atyp: int = 3, command: int = 1) -> bytes:
    address = bytes([len(host)]) + host if atyp == 3 else host
    return bytes([5, command, 0, atyp]) + address + struct.pack("!H", port)


MAPPED = bytes(10) + b"\xff\xff\x7f\x00\x00\x01"  # ::ffff:127.0.0.1


def handshake(host: bytes = b"api.test", port: int = 443, atyp: int = 3) -> bytes:
    return GREETING + AUTH + request(host, port, atyp)


def run(data: bytes, *, allow_no_auth: bool = False, chunks: list[int] | None = None) -> list[Event]:
    """All events for data fed in the given chunk sizes (the rest in one piece), with tunnel data
    joined into one event, so that any two splits compare equal."""
    parser = Socks5Server(allow_no_auth=allow_no_auth)
    events: list[Event] = []
    offset = 0
    for size in [*(chunks or []), len(data)]:
        events += parser.feed(data[offset : offset + size])
        assert parser.buffered <= MAX_MESSAGE
        offset += size
        if offset >= len(data):
            break
    return _join_tunnel(events)


def _join_tunnel(events: list[Event]) -> list[Event]:
    out: list[Event] = []
    tunnel = b""
    for event in events:
        if isinstance(event, TunnelData):
            tunnel += event.data
        else:
            out.append(event)
    return [*out, TunnelData(tunnel)] if tunnel else out


def error_of(data: bytes, *, allow_no_auth: bool = False) -> Socks5Error:
    with pytest.raises(Socks5Error) as info:
        run(data, allow_no_auth=allow_no_auth)
    return info.value


# -- what parses --------------------------------------------------------------------------------------
PARSES: dict[str, tuple[bytes, bool, list[Event]]] = {
    "domain": (
        handshake(),
        False,
        [Greeting(b"\x02", USER_PASS), Credentials("user", "token"), Request("api.test", 443, 3)],
    ),
    "ipv4": (
        handshake(bytes([127, 0, 0, 1]), 80, atyp=1),
        False,
        [Greeting(b"\x02", USER_PASS), Credentials("user", "token"), Request("127.0.0.1", 80, 1)],
    ),
    "ipv6": (
        handshake(bytes(15) + b"\x01", 8080, atyp=4),
        False,
        [Greeting(b"\x02", USER_PASS), Credentials("user", "token"), Request("::1", 8080, 4)],
    ),
    "ipv4-mapped ipv6 stays as written (the policy canonicalises)": (
        handshake(MAPPED, 80, atyp=4),
        False,
        [
            Greeting(b"\x02", USER_PASS),
            Credentials("user", "token"),
            Request(str(ipaddress.ip_address(MAPPED)), 80, 4),
        ],
    ),
    "both methods offered: USER/PASS chosen": (
        b"\x05\x02\x00\x02" + AUTH + request(b"a.test"),
        False,
        [Greeting(b"\x00\x02", USER_PASS), Credentials("user", "token"), Request("a.test", 443, 3)],
    ),
    "both methods on an implicit listener: USER/PASS still chosen": (
        b"\x05\x02\x00\x02" + AUTH + request(b"a.test"),
        True,
        [Greeting(b"\x00\x02", USER_PASS), Credentials("user", "token"), Request("a.test", 443, 3)],
    ),
    "no auth on an implicit listener": (
        b"\x05\x01\x00" + request(b"a.test"),
        True,
        [Greeting(b"\x00", NO_AUTH), Request("a.test", 443, 3)],
    ),
    "255 methods": (
        b"\x05\xff" + bytes(range(255)) + AUTH + request(b"a.test"),
        False,
        [Greeting(bytes(range(255)), USER_PASS), Credentials("user", "token"), Request("a.test", 443, 3)],
    ),
    "trailing bytes are the tunnel's first bytes": (
        handshake() + b"\x16\x03\x01hello",
        False,
        [
            Greeting(b"\x02", USER_PASS),
            Credentials("user", "token"),
            Request("api.test", 443, 3),
            TunnelData(b"\x16\x03\x01hello"),
        ],
    ),
    "a name of 255 bytes": (
        handshake(b"a" * 255),
        False,
        [Greeting(b"\x02", USER_PASS), Credentials("user", "token"), Request("a" * 255, 443, 3)],
    ),
    "255-byte user and password": (
        GREETING + b"\x01\xff" + b"u" * 255 + b"\xff" + b"p" * 255 + request(b"a.test"),
        False,
        [Greeting(b"\x02", USER_PASS), Credentials("u" * 255, "p" * 255), Request("a.test", 443, 3)],
    ),
    "empty user and password (checked as wrong, not a crash)": (
        GREETING + b"\x01\x00\x00" + request(b"a.test"),
        False,
        [Greeting(b"\x02", USER_PASS), Credentials("", ""), Request("a.test", 443, 3)],
    ),
    "non-UTF-8 credentials are None (wrong credentials)": (
        GREETING + b"\x01\x02\xff\xfe\x02\xc3\x28" + request(b"a.test"),
        False,
        [Greeting(b"\x02", USER_PASS), Credentials(None, None), Request("a.test", 443, 3)],
    ),
    "'%' is left to the policy (it refuses zone IDs and percent-encoding)": (
        handshake(b"allowed%2etest"),
        False,
        [Greeting(b"\x02", USER_PASS), Credentials("user", "token"), Request("allowed%2etest", 443, 3)],
    ),
    "port 65535": (
        handshake(b"a.test", 65535),
        False,
        [Greeting(b"\x02", USER_PASS), Credentials("user", "token"), Request("a.test", 65535, 3)],
    ),
}


@pytest.mark.parametrize("name", PARSES)
def test_parses(name: str) -> None:
    data, implicit, expected = PARSES[name]
    assert run(data, allow_no_auth=implicit) == expected


@pytest.mark.parametrize("name", PARSES)
def test_every_split_point_parses_the_same(name: str) -> None:
    data, implicit, expected = PARSES[name]
    for cut in range(len(data) + 1):
        assert run(data, allow_no_auth=implicit, chunks=[cut]) == expected, cut


@pytest.mark.parametrize("name", PARSES)
def test_one_byte_at_a_time(name: str) -> None:
    data, implicit, expected = PARSES[name]
    assert run(data, allow_no_auth=implicit, chunks=[1] * len(data)) == expected


@pytest.mark.parametrize("name", PARSES)
def test_truncated_waits_for_more(name: str) -> None:
    """Any strict prefix yields only the events it completes, never an error or a guess."""
    data, implicit, expected = PARSES[name]
    for end in range(len(data)):
        events = run(data[:end], allow_no_auth=implicit)
        complete = [e for e in events if not isinstance(e, TunnelData)]
        assert complete == expected[: len(complete)], end
        tunnel = [e for e in events if isinstance(e, TunnelData)]
        if tunnel:  # only what arrived of the tunnel's first bytes, after the request
            assert isinstance(expected[-1], TunnelData) and expected[-1].data.startswith(tunnel[0].data)


# -- what is refused, and with which reply ------------------------------------------------------------
REFUSED: dict[str, tuple[bytes, bool, bytes, str]] = {
    # name: (bytes, implicit listener, reply to send, reason)
    "socks4": (b"\x04\x01\x00\x50\x7f\x00\x00\x01\x00", False, b"", "bad_request"),
    "http on the socks port": (b"GET / HTTP/1.1\r\n", False, b"", "bad_request"),
    "tls on the socks port": (b"\x16\x03\x01\x00\x10", False, b"", "bad_request"),
    "no auth only": (b"\x05\x01\x00", False, b"\x05\xff", "proxy_auth_required"),
    "gssapi only": (b"\x05\x01\x01", True, b"\x05\xff", "proxy_auth_required"),
    "zero methods": (b"\x05\x00", False, b"\x05\xff", "proxy_auth_required"),
    "auth version 5": (GREETING + b"\x05\x04user\x05token", False, b"\x01\x01", "proxy_auth_required"),
    "request version 4": (GREETING + AUTH + b"\x04\x01\x00\x01", False, reply(1), "bad_request"),
    "bind": (GREETING + AUTH + request(b"a.test", command=2), False, reply(7), "bad_request"),
    "udp associate": (GREETING + AUTH + request(b"a.test", command=3), False, reply(7), "bad_request"),
    "unknown command": (GREETING + AUTH + request(b"a.test", command=0x7F), False, reply(7), "bad_request"),
    "reserved byte": (GREETING + AUTH + b"\x05\x01\x01\x03\x01a\x00\x50", False, reply(1), "bad_request"),
    "atyp 2": (GREETING + AUTH + b"\x05\x01\x00\x02", False, reply(8), "bad_request"),
    "atyp 0xff": (GREETING + AUTH + b"\x05\x01\x00\xff", False, reply(8), "bad_request"),
    "empty name": (handshake(b""), False, reply(2), "invalid_target"),
    "port 0": (handshake(b"a.test", 0), False, reply(2), "invalid_target"),
    "port 0, ipv4": (handshake(bytes([1, 2, 3, 4]), 0, atyp=1), False, reply(2), "invalid_target"),
    "NUL in the name": (handshake(b"a.test\x00.evil.test"), False, reply(2), "invalid_target"),
    "CR LF in the name": (handshake(b"a.test\r\nHost: b"), False, reply(2), "invalid_target"),
    "LF in the name": (handshake(b"a.test\n"), False, reply(2), "invalid_target"),
    "space in the name": (handshake(b"a.test b.test"), False, reply(2), "invalid_target"),
    "tab in the name": (handshake(b"a\t.test"), False, reply(2), "invalid_target"),
    "DEL in the name": (handshake(b"a\x7f.test"), False, reply(2), "invalid_target"),
    "UTF-8 in the name": (handshake("bücher.test".encode()), False, reply(2), "invalid_target"),
    "latin-1 in the name": (handshake(b"b\xfccher.test"), False, reply(2), "invalid_target"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_refused(name: str) -> None:
    data, implicit, answer, reason = REFUSED[name]
    error = error_of(data, allow_no_auth=implicit)
    assert (error.reply, error.reason) == (answer, reason)
    assert str(error)  # a message that says what was wrong


@pytest.mark.parametrize("name", REFUSED)
def test_refused_the_same_one_byte_at_a_time(name: str) -> None:
    data, implicit, answer, reason = REFUSED[name]
    parser = Socks5Server(allow_no_auth=implicit)
    with pytest.raises(Socks5Error) as info:
        for i in range(len(data)):
            parser.feed(data[i : i + 1])
    assert (info.value.reply, info.value.reason) == (answer, reason)
    with pytest.raises(Socks5Error):  # and it stays failed
        parser.feed(b"\x05")


def test_version_errors_say_what_they_saw() -> None:
    assert "0x04" in str(error_of(b"\x04\x01"))
    assert "0x47" in str(error_of(b"GET"))


def test_a_wrong_version_is_refused_at_its_first_byte() -> None:
    with pytest.raises(Socks5Error):
        Socks5Server().feed(b"G")
    parser = Socks5Server()
    parser.feed(GREETING)
    with pytest.raises(Socks5Error):
        parser.feed(b"\x05")  # an auth message starts with 0x01


# -- bounds ---------------------------------------------------------------------------------------------
def test_never_holds_more_than_one_message() -> None:
    parser = Socks5Server()
    parser.feed(GREETING + AUTH)
    parser.feed(b"\x05\x01\x00\x03\xff" + b"a" * 200)
    assert parser.buffered == 205 <= MAX_MESSAGE
    events = parser.feed(b"a" * 55 + b"\x01\xbb" + b"x" * 100_000)
    assert parser.buffered == 0
    assert events == [Request("a" * 255, 443, 3), TunnelData(b"x" * 100_000)]
    assert parser.done
    assert parser.feed(b"more") == [TunnelData(b"more")]
    assert parser.buffered == 0


def test_huge_lengths_are_bounded_by_the_wire_format() -> None:
    """Every length field is one byte: 255 is the most any of them can claim."""
    parser = Socks5Server()
    parser.feed(b"\x05\xff")
    assert parser.feed(b"\x00" * 254) == []
    assert parser.buffered == 256
    assert parser.feed(b"\x02") == [Greeting(bytes(254) + b"\x02", USER_PASS)]
    parser.feed(b"\x01\xff" + b"u" * 255 + b"\xff" + b"p" * 254)
    assert parser.buffered == MAX_MESSAGE - 1


def test_one_byte_writes_cost_linear_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """A handshake trickled in byte by byte is read at a bounded cost per byte: each message is
    looked at only when enough bytes for its next length field or its end have arrived (never
    re-parsed from its start on every read), whatever its size. Counted, not timed."""
    steps = 0
    step = Socks5Server._step

    def counting(self: Socks5Server) -> Event | None:
        nonlocal steps
        steps += 1
        return step(self)

    monkeypatch.setattr(Socks5Server, "_step", counting)
    longest = GREETING + b"\x01\xff" + b"u" * 255 + b"\xff" + b"p" * 255 + request(b"a" * 255)
    for data in (handshake(b"a.test"), longest):
        steps = 0
        parser = Socks5Server()
        for i in range(len(data)):
            parser.feed(data[i : i + 1])
        assert parser.done
        assert steps <= 11  # greeting 3, auth 4, request 4: the same for 30 bytes or 800
        for _ in range(10_000):
            parser.feed(b"x")  # tunnel bytes: handed back at once, never parsed
        assert steps <= 11


# -- replies --------------------------------------------------------------------------------------------
def test_replies() -> None:
    assert Greeting(b"\x02", USER_PASS).reply == b"\x05\x02"
    assert Greeting(b"\x00", NO_AUTH).reply == b"\x05\x00"
    assert auth_reply(True) == b"\x01\x00" and auth_reply(False) == b"\x01\x01"
    assert reply(Reply.SUCCEEDED, ("127.0.0.1", 4242)) == b"\x05\x00\x00\x01\x7f\x00\x00\x01\x10\x92"
    assert reply(Reply.SUCCEEDED, ("::1", 1)) == b"\x05\x00\x00\x04" + bytes(15) + b"\x01\x00\x01"
    assert reply(Reply.NOT_ALLOWED) == b"\x05\x02\x00\x01" + bytes(6)
    codes = {r.name: r.value for r in Reply}
    assert codes == {
        "SUCCEEDED": 0,
        "GENERAL_FAILURE": 1,
        "NOT_ALLOWED": 2,
        "NETWORK_UNREACHABLE": 3,
        "HOST_UNREACHABLE": 4,
        "CONNECTION_REFUSED": 5,
        "TTL_EXPIRED": 6,
        "COMMAND_NOT_SUPPORTED": 7,
        "ADDRESS_TYPE_NOT_SUPPORTED": 8,
    }
    assert NO_ACCEPTABLE == 0xFF


# -- properties -----------------------------------------------------------------------------------------
names = st.binary(min_size=1, max_size=255).filter(lambda b: all(0x20 < c < 0x7F for c in b))
addresses = st.one_of(
    names.map(lambda n: (3, n)),
    st.binary(min_size=4, max_size=4).map(lambda a: (1, a)),
    st.binary(min_size=16, max_size=16).map(lambda a: (4, a)),
)


@st.composite
def valid_handshakes(draw: st.DrawFn) -> bytes:
    methods = draw(st.lists(st.integers(0, 255), min_size=0, max_size=20))
    methods.append(USER_PASS)
    user = draw(st.binary(max_size=255))
    password = draw(st.binary(max_size=255))
    atyp, address = draw(addresses)
    port = draw(st.integers(1, 65535))
    tail = draw(st.binary(max_size=50))
    return (
        bytes([5, len(methods), *methods])
        + bytes([1, len(user)])
        + user
        + bytes([len(password)])
        + password
        + request(address, port, atyp)
        + tail
    )


@settings(max_examples=300, deadline=None)
@given(valid_handshakes(), st.lists(st.integers(0, 600), max_size=8))
def test_any_split_of_a_valid_handshake_parses_the_same(data: bytes, cuts: list[int]) -> None:
    whole = run(data)
    assert [type(e) for e in whole[:3]] == [Greeting, Credentials, Request]
    assert run(data, chunks=cuts) == whole


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=700), st.booleans(), st.lists(st.integers(1, 50), max_size=10))
def test_random_bytes_raise_only_the_module_error(data: bytes, implicit: bool, cuts: list[int]) -> None:
    with contextlib.suppress(Socks5Error):
        run(data, allow_no_auth=implicit, chunks=cuts)


@settings(max_examples=300, deadline=None)
@given(valid_handshakes(), st.integers(0, 10_000), st.integers(0, 255))
def test_one_changed_byte_raises_only_the_module_error(data: bytes, where: int, value: int) -> None:
    mutated = bytearray(data)
    mutated[where % len(mutated)] = value
    try:
        events = run(bytes(mutated))
    except Socks5Error:
        return
    for event in events:
        if isinstance(event, Request):
            assert 0 < event.port < 65536 and event.host
            assert all(0x20 < ord(c) < 0x7F for c in event.host)
