"""egressd.wire.http1: the proxy's HTTP/1 reader and writer on both sides (h11 behind the head guard).

Table tests for the smuggling and malformed-head cases a proxy must refuse, byte-at-a-time and
pipelined feeds, the upstream side's framing (1xx, HEAD/204/304, close-delimited, broken chunks),
and hypothesis properties: any split of valid bytes gives the same events, and random bytes never
raise anything but WireError.
"""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from egressd.wire.http1 import (
    Body,
    ClientSide,
    End,
    Event,
    RequestHead,
    ResponseHead,
    ServerSide,
    Switched,
    WireError,
    read_connect,
    split_target,
    take_head,
    upstream_headers,
)
from egressd.wire.http_head import HeadScanner, head_problem, leading_empty_lines
from egressd.wire.remembered import REMEMBERED_HEADS


def _head(first: str, *headers: str) -> bytes:
    return ("\r\n".join([first, *headers]) + "\r\n\r\n").encode("latin-1")


POST = "POST http://h/ HTTP/1.1"


def _read(raw: bytes, step: int | None = None) -> list[Event]:
    """Every event of the requests in raw (pipelined ones too), fed `step` bytes at a time."""
    side = ClientSide()
    pieces = [raw] if step is None else [raw[i : i + step] for i in range(0, len(raw), step)]
    events: list[Event] = []
    for piece in pieces:
        events += side.receive(piece)
        while events and isinstance(events[-1], End) and side.done:
            events += side.response(ResponseHead(204, "No Content", [])) and []
            events += side.end([]) and []
            if not side.next_request():
                return events
            events += side.receive(b"")
    events += side.receive_eof()
    return events


def _merged(events: list[Event]) -> list[Event]:
    """Adjacent Body events joined (how the body is split is not part of the meaning)."""
    out: list[Event] = []
    for event in events:
        if isinstance(event, Body) and out and isinstance(out[-1], Body):
            out[-1] = Body(out[-1].data + event.data)
        else:
            out.append(event)
    return out


# -- what the child may send ---------------------------------------------------------------------
def test_absolute_form_request_split_once_host_as_written() -> None:
    [head, end] = _read(_head("GET http://Up.Test:8080/a?b=1 HTTP/1.1", "Host: up.test:8080"))
    assert isinstance(head, RequestHead) and isinstance(end, End)
    assert (head.method, head.scheme, head.host, head.port, head.path) == (
        "GET",
        "http",
        "Up.Test",
        8080,
        "/a?b=1",
    )
    assert head.headers == [("Host", "up.test:8080")]


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        ("http://h", ("http", "h", 80, "/")),
        ("HTTP://h:81/?q", ("http", "h", 81, "/?q")),
        ("http://[::1]:8080/x", ("http", "::1", 8080, "/x")),
        ("http://[::ffff:127.0.0.1]/", ("http", "::ffff:127.0.0.1", 80, "/")),
        ("http://0x7f.1:0080/", ("http", "0x7f.1", 80, "/")),
        ("http://allowed%2etest/", ("http", "allowed%2etest", 80, "/")),
    ],
)
def test_target_spellings_are_split_not_judged(target: str, expected: tuple[str, str, int, str]) -> None:
    """The decision canonicalises (and refuses) host spellings; the reader only splits them."""
    assert split_target(target) == expected


REFUSED = [
    ("origin-form", _head("GET / HTTP/1.1", "Host: h")),
    ("authority-form", _head("GET h:80 HTTP/1.1", "Host: h")),
    ("asterisk-form", _head("OPTIONS * HTTP/1.1", "Host: h")),
    ("connect-pipelined", _head("CONNECT h:443 HTTP/1.1", "Host: h:443")),
    ("https-target", _head("GET https://h/ HTTP/1.1", "Host: h")),
    ("ftp-target", _head("GET ftp://h/ HTTP/1.1", "Host: h")),
    ("userinfo", _head("GET http://a@evil/ HTTP/1.1", "Host: evil")),
    ("backslash", _head("GET http://a\\@evil/ HTTP/1.1", "Host: evil")),
    ("fragment", _head("GET http://h/#f HTTP/1.1", "Host: h")),
    ("query-without-path", _head("GET http://evil?@good/ HTTP/1.1", "Host: good")),
    ("name-in-brackets", _head("GET http://[h]/ HTTP/1.1", "Host: [h]")),
    ("port-zero", _head("GET http://h:0/ HTTP/1.1", "Host: h")),
    ("port-big", _head("GET http://h:65536/ HTTP/1.1", "Host: h")),
    ("port-sign", _head("GET http://h:+80/ HTTP/1.1", "Host: h")),
    ("two-host-fields", _head("GET http://h/ HTTP/1.1", "Host: h", "Host: h")),
    ("non-ascii-line", _head("GET http://h/caf\xe9 HTTP/1.1", "Host: h")),
    ("cl-and-te", _head(POST, "Host: h", "Content-Length: 5", "Transfer-Encoding: chunked")),
    ("te-and-cl", _head(POST, "Host: h", "Transfer-Encoding: chunked", "Content-Length: 5")),
    ("duplicate-cl-equal", _head(POST, "Host: h", "Content-Length: 5", "Content-Length: 5")),
    ("duplicate-cl-differing", _head(POST, "Host: h", "Content-Length: 5", "Content-Length: 6")),
    ("cl-list", _head(POST, "Host: h", "Content-Length: 5, 5")),
    ("cl-plus", _head(POST, "Host: h", "Content-Length: +5")),
    ("cl-hex", _head(POST, "Host: h", "Content-Length: 0x5")),
    ("te-identity", _head(POST, "Host: h", "Transfer-Encoding: identity")),
    ("te-identity-chunked", _head(POST, "Host: h", "Transfer-Encoding: identity, chunked")),
    ("te-chunked-chunked", _head(POST, "Host: h", "Transfer-Encoding: chunked, chunked")),
    ("te-twice", _head(POST, "Host: h", "Transfer-Encoding: chunked", "Transfer-Encoding: chunked")),
    ("te-xchunked", _head(POST, "Host: h", "Transfer-Encoding: xchunked")),
    ("connection-content-length", _head(POST, "Host: h", "Connection: content-length", "Content-Length: 5")),
    ("connection-te", _head(POST, "Host: h", "Connection: close, Transfer-Encoding")),
    ("connection-host", _head("GET http://h/ HTTP/1.1", "Host: h", "Connection: host")),
    ("obs-fold", _head("GET http://h/ HTTP/1.1", "Host: h", "X-A: a", " b")),
    (
        "obs-fold-hiding-te",
        _head(POST, "Host: h", "Content-Length: 5", "X-A: a", " Transfer-Encoding: chunked"),
    ),
    ("space-before-colon", _head("GET http://h/ HTTP/1.1", "Host: h", "Transfer-Encoding : chunked")),
    ("no-colon", _head("GET http://h/ HTTP/1.1", "Host: h", "X-No-Colon")),
    ("nul", _head("GET http://h/ HTTP/1.1", "Host: h", "X-A: a\x00b")),
    ("vertical-tab", _head(POST, "Host: h", "Transfer-Encoding:\x0bchunked")),
    ("bare-lf", b"GET http://h/ HTTP/1.1\nHost: h\n\n"),
    ("bare-lf-one-line", b"GET http://h/ HTTP/1.1\r\nHost: h\nX: 1\r\n\r\n"),
    ("bare-cr", b"GET http://h/ HTTP/1.1\r\nHost: h\rX: 1\r\n\r\n"),
    ("http-0.9", b"GET http://h/\r\n\r\n"),
    ("bad-version", _head("GET http://h/ HTTP/1.1x", "Host: h")),
    (
        "two-proxy-authorizations",
        _head("GET http://h/ HTTP/1.1", "Host: h", "Proxy-Authorization: a", "Proxy-Authorization: b"),
    ),
    ("huge-head", _head("GET http://h/ HTTP/1.1", "Host: h", "X: " + "a" * 70000)),
    (
        "chunk-size-not-hex",
        _head(POST, "Host: h", "Transfer-Encoding: chunked") + b"0x5\r\nhello\r\n0\r\n\r\n",
    ),
    ("chunk-size-overflow", _head(POST, "Host: h", "Transfer-Encoding: chunked") + b"1" * 30 + b"\r\n"),
    ("chunk-without-crlf", _head(POST, "Host: h", "Transfer-Encoding: chunked") + b"5\r\nhelloXX0\r\n\r\n"),
]


@pytest.mark.parametrize("raw", [c[1] for c in REFUSED], ids=[c[0] for c in REFUSED])
@pytest.mark.parametrize("step", [None, 1])
def test_ambiguous_or_malformed_requests_are_refused(raw: bytes, step: int | None) -> None:
    """Whole or one byte at a time: a WireError (400, 431 for a huge head), never a request whose
    framing two parsers could read differently."""
    with pytest.raises(WireError) as caught:
        _read(raw, step)
    assert caught.value.status in (400, 431)


def test_a_missing_host_field_is_fine_two_are_a_mismatch() -> None:
    """The target names the host (the upstream gets the canonical Host); two Host fields are refused
    as host_mismatch, with the request attached for the audit record."""
    [head, end] = _read(_head("GET http://h/ HTTP/1.1", "X-A: 1"))
    assert isinstance(head, RequestHead) and head.headers == [("X-A", "1")] and isinstance(end, End)
    with pytest.raises(WireError) as caught:
        _read(_head("GET http://h/p HTTP/1.1", "Host: h", "Host: evil"))
    assert caught.value.reason == "host_mismatch" and caught.value.head is not None
    assert caught.value.head.path == "/p"


def test_non_ascii_request_line_is_named_escaped() -> None:
    with pytest.raises(WireError, match=r"caf\\xe9"):
        _read(b"GET http://h/caf\xe9 HTTP/1.1\r\nHost: h\r\n\r\n")


def test_chunked_body_with_extension_and_trailers_one_byte_at_a_time() -> None:
    body = b"5;name=value\r\nhello\r\nA\r\n0123456789\r\n0\r\nX-T: 1\r\n\r\n"
    events = _merged(_read(_head(POST, "Host: h", "Transfer-Encoding: chunked") + body, step=1))
    assert events[1:] == [Body(b"hello0123456789"), End([("X-T", "1")])]


def test_leading_empty_lines_are_ignored_before_each_request() -> None:
    one = _head("GET http://h/1 HTTP/1.1", "Host: h")
    two = _head("GET http://h/2 HTTP/1.1", "Host: h")
    events = _read(b"\r\n\r\n" + one + b"\r\n" + two)
    assert [e.path for e in events if isinstance(e, RequestHead)] == ["/1", "/2"]


def test_pipelined_requests_are_parsed_one_at_a_time_and_each_is_guarded() -> None:
    """The second head waits unparsed until the first exchange is done, then gets the same guard."""
    side = ClientSide()
    first = _head(POST, "Host: h", "Content-Length: 3") + b"abc"
    smuggled = _head(POST, "Host: h", "Content-Length: 1", "Transfer-Encoding: chunked")
    events = side.receive(first + smuggled)
    assert [type(e) for e in events] == [RequestHead, Body, End] and side.buffered == len(smuggled)
    side.response(ResponseHead(200, "OK", [("Content-Length", "0")]))
    side.end([])
    assert side.next_request()
    with pytest.raises(WireError, match="both Content-Length and Transfer-Encoding"):
        side.receive(b"")


def test_http10_client_gets_a_close_delimited_response() -> None:
    side = ClientSide()
    side.receive(_head("GET http://h/ HTTP/1.0"))
    head = side.response(ResponseHead(200, "OK", [("Transfer-Encoding", "chunked")]))
    assert b"chunked" not in head.lower() and b"connection: close" in head.lower()
    assert side.body(b"abc") == b"abc"
    side.end([("X-T", "1")])  # trailers cannot go to an HTTP/1.0 client: dropped
    assert not side.next_request()


def test_response_to_the_child_loses_hop_by_hop_and_egressd_headers() -> None:
    side = ClientSide()
    side.receive(_head("GET http://h/ HTTP/1.1", "Host: h"))
    fields = [
        ("Connection", "close, X-Hop"),
        ("X-Hop", "1"),
        ("Keep-Alive", "timeout=5"),
        ("X-Egressd-Reason", "forged"),
        ("Proxy-Status", "forged"),
        ("Content-Length", "2"),
        ("X-Kept", "1"),
    ]
    head = side.response(ResponseHead(200, "OK", fields)).lower()
    assert b"x-hop" not in head and b"keep-alive" not in head and b"egressd" not in head
    assert b"proxy-status" not in head and b"x-kept: 1" in head and b"content-length: 2" in head


# -- what goes upstream ----------------------------------------------------------------------------
def test_upstream_request_is_origin_form_with_canonical_host_and_no_proxy_fields() -> None:
    [head, _] = _read(
        _head(
            "GET http://UP.test./p?q HTTP/1.1",
            "Host: UP.test.",
            "Proxy-Authorization: Basic eA==",
            "Proxy-Connection: keep-alive",
            "Connection: keep-alive, X-Secret",
            "X-Secret: 1",
            "Upgrade: h2c",
            "Cookie: a=b",
        )
    )
    assert isinstance(head, RequestHead)
    server = ServerSide()
    sent = server.request(head, upstream_headers(head, "up.test", 80, {"cookie"}))
    assert sent == b"GET /p?q HTTP/1.1\r\nHost: up.test\r\n\r\n"


def test_upstream_request_without_host_gets_the_canonical_one() -> None:
    [head, _] = _read(_head("GET http://h:8080/ HTTP/1.0"))
    assert isinstance(head, RequestHead)
    assert upstream_headers(head, "h", 8080, set()) == [("Host", "h:8080")]


def test_upgrade_is_kept_only_as_an_upgrade() -> None:
    [head, _] = _read(
        _head("GET http://h/ws HTTP/1.1", "Host: h", "Connection: Upgrade", "Upgrade: websocket")
    )
    assert isinstance(head, RequestHead) and head.upgrade
    assert upstream_headers(head, "h", 80, set()) == [
        ("Host", "h"),
        ("Upgrade", "websocket"),
        ("Connection", "Upgrade"),
    ]


def test_a_request_written_again_is_written_as_the_first_time() -> None:
    """request_to writes what request() of upstream_headers() writes, and its state for the answer
    (an upgrade asked, a body still going out) is that request's, also for a head written again
    after another one."""
    [get, _] = _read(_head("GET http://h/ HTTP/1.1", "Host: h", "Cookie: a=b", "Connection: x-a", "X-A: 1"))
    [ws, _] = _read(_head("GET http://h/ws HTTP/1.1", "Host: h", "Connection: Upgrade", "Upgrade: websocket"))
    [post, *_] = ClientSide().receive(_head("POST http://h/ HTTP/1.1", "Host: h", "Content-Length: 2"))
    assert isinstance(get, RequestHead) and isinstance(ws, RequestHead) and isinstance(post, RequestHead)

    def state(side: ServerSide) -> tuple[object, ...]:
        return (
            side.in_head,
            side.complete,
            side.closes,
            side.method,
            side.upgrade,
            side.chunked,
            side.sending,
        )

    server = ServerSide()
    for head, strip in [
        (get, frozenset()),
        (get, frozenset()),
        (ws, frozenset()),
        (post, frozenset()),
        (get, frozenset({"cookie"})),
        (get, frozenset({"cookie"})),
        (ws, frozenset()),
        (get, frozenset()),
    ]:
        fresh = ServerSide()
        expected = fresh.request(head, upstream_headers(head, "h", 80, set(strip)))
        assert server.request_to(head, "h", 80, strip) == expected
        assert state(server) == state(fresh)
        server.end()
    assert server.request_to(get, "h", 8080, frozenset()).startswith(b"GET / HTTP/1.1\r\nHost: h:8080\r\n")


def test_a_response_head_framed_again_is_framed_as_the_first_time() -> None:
    """read_response remembers heads by their exact bytes; ClientSide.response frames the same
    head again as a fresh side would, for every kind of request in turn (HEAD, HTTP/1.0, a
    request that closes), its framing state included."""
    from egressd.wire import http1

    raw = b"HTTP/1.1 200 OK\r\nConnection: x-a\r\nX-A: 1\r\nServer: s\r\n\r\n"
    first = http1.read_response(raw)
    assert http1.read_response(bytes(raw)) == first == http1._read_response(raw)
    assert first[0] is http1.read_response(raw)[0] and first[1:] == (None, False, False)
    sized = http1.read_response(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n")[0]
    requests = [
        _head("GET http://h/ HTTP/1.1", "Host: h"),
        _head("HEAD http://h/ HTTP/1.1", "Host: h"),
        _head("GET http://h/ HTTP/1.0", "Host: h"),
        _head("GET http://h/ HTTP/1.1", "Host: h", "Connection: close"),
        _head("GET http://h/ HTTP/1.1", "Host: h"),
    ]
    side = ClientSide()
    for request in requests * 2:
        for head in (first[0], first[0], sized, first[0]):
            fresh = ClientSide()
            fresh.receive(request)
            side.receive(request)
            assert side.response(head) == fresh.response(head)
            assert (side.chunked_out, side.keep_alive) == (fresh.chunked_out, fresh.keep_alive)
            side.end([])
            side.next_request()
    for _ in range(3):
        with pytest.raises(WireError):
            http1.read_response(b"HTTP/1.1 099 No\r\n\r\n")


# -- what the upstream answers ---------------------------------------------------------------------
def _exchange(method: str, response: bytes, step: int | None = None, eof: bool = False) -> list[Event]:
    side = ClientSide()
    [head, *_] = side.receive(_head(f"{method} http://h/ HTTP/1.1", "Host: h"))
    assert isinstance(head, RequestHead)
    server = ServerSide()
    server.request(head, upstream_headers(head, "h", 80, set()))
    server.end()
    pieces = [response] if step is None else [response[i : i + step] for i in range(0, len(response), step)]
    events: list[Event] = []
    for piece in pieces:
        events += server.receive(piece)
    if eof:
        events += server.receive_eof()
    return _merged(events)


OK = b"HTTP/1.1 200 OK\r\n"


@pytest.mark.parametrize("step", [None, 1])
def test_upstream_framing(step: int | None) -> None:
    assert _exchange("GET", OK + b"Content-Length: 2\r\n\r\nok", step)[1:] == [Body(b"ok"), End([])]
    chunked = OK + b"Transfer-Encoding: chunked\r\n\r\n5;x=1\r\nhello\r\n0\r\nT: 1\r\n\r\n"
    assert _exchange("GET", chunked, step)[1:] == [Body(b"hello"), End([("T", "1")])]
    assert _exchange("GET", OK + b"\r\nuntil-eof", step, eof=True)[1:] == [Body(b"until-eof"), End([])]
    assert _exchange("HEAD", OK + b"Content-Length: 10\r\n\r\n", step)[1:] == [End([])]
    assert _exchange("GET", b"HTTP/1.1 204 No Content\r\n\r\n", step)[1:] == [End([])]
    assert _exchange("GET", b"HTTP/1.1 304 Not Modified\r\nContent-Length: 10\r\n\r\n", step)[1:] == [End([])]


def test_interim_responses_come_before_the_final_one() -> None:
    events = _exchange(
        "GET",
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early\r\nLink: </a>\r\n\r\n"
        + OK
        + b"Content-Length: 0\r\n\r\n",
    )
    assert [e.status for e in events if isinstance(e, ResponseHead)] == [100, 103, 200]


def test_101_hands_over_the_rest_of_the_bytes() -> None:
    side = ClientSide()
    [head, _] = side.receive(
        _head("GET http://h/ HTTP/1.1", "Host: h", "Connection: upgrade", "Upgrade: websocket")
    )
    assert isinstance(head, RequestHead)
    server = ServerSide()
    server.request(head, upstream_headers(head, "h", 80, set()))
    server.end()
    events = server.receive(
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n\x81\x01a"
    )
    assert isinstance(events[0], ResponseHead) and events[1] == Switched(b"\x81\x01a")
    assert b"101" in side.interim(events[0])


@pytest.mark.parametrize(
    "response",
    [
        OK + b"Content-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n",
        OK + b"Content-Length: 1, 2\r\n\r\n",
        OK + b"Transfer-Encoding: chunked\r\n\r\n5\r\nhelloXX0\r\n\r\n",
        OK + b"X: a\r\n b\r\n\r\n",
        b"HTTP/1.1 200 OK\nContent-Length: 0\n\n",
        b"HTTP/1.1 101 Switching Protocols\r\n\r\n",  # no upgrade was asked for
        b"SSH-2.0-OpenSSH\r\n\r\n",
    ],
)
def test_broken_upstream_responses_are_errors(response: bytes) -> None:
    with pytest.raises(WireError):
        _exchange("GET", response, eof=True)


def test_upstream_connection_is_reused_only_after_a_clean_exchange() -> None:
    side = ClientSide()
    [head, _] = side.receive(_head("GET http://h/ HTTP/1.1", "Host: h"))
    assert isinstance(head, RequestHead)
    server = ServerSide()
    server.request(head, upstream_headers(head, "h", 80, set()))
    server.end()
    server.receive(OK + b"Content-Length: 0\r\n\r\n")
    assert server.reusable()
    server.request(head, upstream_headers(head, "h", 80, set()))
    server.end()
    server.receive(OK + b"Content-Length: 0\r\n\r\nextra")  # bytes nobody asked for
    assert not server.reusable()


# -- properties ------------------------------------------------------------------------------------
VALID = [
    _head("GET http://h/a HTTP/1.1", "Host: h") + _head(POST, "Host: h", "Content-Length: 3") + b"xyz",
    b"\r\n"
    + _head(POST, "Host: h", "Transfer-Encoding: chunked")
    + b"3\r\nabc\r\n1;e=1\r\nd\r\n0\r\nT: 1\r\n\r\n",
    _head("PROPFIND http://h:8080/d HTTP/1.1", "Host: h:8080", "Depth: 1", "Content-Length: 0"),
    _head("GET http://h/ HTTP/1.0"),
]


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(VALID), st.lists(st.integers(1, 40), min_size=1, max_size=60))
def test_any_split_of_valid_bytes_gives_the_same_events(raw: bytes, cuts: list[int]) -> None:
    expected = _merged(_read(raw))
    side_events: list[Event] = []
    side = ClientSide()
    position = 0
    pieces = []
    for cut in cuts:
        pieces.append(raw[position : position + cut])
        position += cut
    pieces.append(raw[position:])
    for piece in pieces:
        side_events += side.receive(piece)
        while side_events and isinstance(side_events[-1], End) and side.done:
            side.response(ResponseHead(204, "No Content", []))
            side.end([])
            if not side.next_request():
                break
            side_events += side.receive(b"")
    side_events += side.receive_eof()
    assert _merged(side_events) == expected


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300), st.integers(1, 50))
def test_random_bytes_raise_only_wire_errors(raw: bytes, step: int) -> None:
    for prefix in (
        b"",
        b"GET http://h/ HTTP/1.1\r\nHost: h\r\n",
        _head(POST, "Host: h", "Transfer-Encoding: chunked"),
    ):
        data = prefix + raw
        with contextlib.suppress(WireError):
            _read(data, step)
        with contextlib.suppress(WireError):
            _exchange("GET", b"HTTP/1.1 " + raw, step, eof=True)


LINES = [b"GET http://h/ HTTP/1.1", b"Host: h", b"X-A: a", b" folded", b"X-B: \x00", b"X-C: a\rb", b"", b"\t"]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from(LINES), min_size=1, max_size=6),
    st.lists(st.sampled_from([b"\r\n", b"\n"]), min_size=6, max_size=6),
    st.lists(st.integers(1, 30), max_size=20),
)
def test_scanner_agrees_with_head_problem(lines: list[bytes], ends: list[bytes], cuts: list[int]) -> None:
    """Fed in any pieces, the incremental scanner refuses exactly what head_problem refuses on the
    whole head, and finds the same end."""
    data = b"".join(line + end for line, end in zip(lines, ends, strict=False)) + b"\r\n"
    scanner = HeadScanner()
    verdict = None
    position = 0
    for cut in [*cuts, len(data)]:
        position = min(len(data), position + cut)
        verdict = scanner.scan(data[:position])
        if verdict is not None:
            break
    expected = head_problem(data)
    if expected is not None:
        assert verdict is not None and verdict[0] != 0, (data, verdict)
    elif leading_empty_lines(data) == len(data):  # only empty lines: no head yet
        assert verdict is None
    else:
        assert verdict is not None and verdict[0] == 0, (data, verdict)
        assert data[: int(verdict[1])].endswith(b"\r\n\r\n")


def _taken(data: bytes) -> tuple[str, object]:
    """take_head on a fresh buffer of `data` read at once: ("head", head, rest) or ("refused", status)."""
    raw = bytearray(data)
    try:
        head = take_head(raw, HeadScanner())
    except WireError as exc:
        return "refused", exc.status
    return "head", (head, bytes(raw))


@pytest.mark.parametrize(
    "data",
    [
        b"CONNECT up.test:443 HTTP/1.1\r\nHost: up.test:443\r\n\r\n",
        b"GET http://a.test/ HTTP/1.1\r\nHost: a.test\r\n\r\n",
        b"\r\nGET http://a.test/ HTTP/1.1\r\nHost: a.test\r\n\r\n",  # an empty line before it
        b"GET / HTTP/1.1\nHost: a.test\r\n\r\n",  # bare LF
        b"GET / HTTP/1.1\r\nX-A: a\rTransfer-Encoding: chunked\r\n\r\n",  # bare CR
        b"GET / HTTP/1.1\r\nX-A: a\r\n Transfer-Encoding: chunked\r\n\r\n",  # obs-fold
        b"CONNECT up.test:443 HTTP/1.1\r\nX: \x00\r\n\r\n",  # a control byte
        b"CONNECT up.test:443 HTTP/1.1\r\n\r\n\r\n",  # a second empty line: the rest is not the head
        b"CONNECT up.test:443 HTTP/1.1\r\nHost: up.test:443\r\n\r\n\x16\x03\x01",  # bytes after it
    ],
)
def test_a_head_taken_again_answers_as_the_guard_did(data: bytes) -> None:
    """take_head remembers the clean heads it read whole: the same bytes again, the same answer as
    the guard's (a refused head is refused every time), and a head one byte apart is guarded on
    its own."""
    first = _taken(data)
    assert _taken(data) == _taken(bytes(data)) == first
    for i in range(len(data)):  # every byte changed to what the guard refuses
        for bad in (b"\x00", b"\n", b"\r"):
            changed = data[:i] + bad + data[i + 1 :]
            fresh = HeadScanner().scan(changed)
            verdict = _taken(changed)
            if fresh is not None and fresh[0]:
                assert verdict == ("refused", fresh[0]), changed


@settings(max_examples=500, deadline=None)
@given(
    st.lists(st.sampled_from([*LINES, b"CONNECT h:1 HTTP/1.1"]), min_size=1, max_size=5),
    st.binary(max_size=8),
)
def test_a_remembered_head_never_passes_what_the_guard_refuses(lines: list[bytes], tail: bytes) -> None:
    """Heads read twice: the second answer is the first, and both are the guard's."""
    data = b"".join(line + b"\r\n" for line in lines) + b"\r\n" + tail
    first, second = _taken(data), _taken(data)
    assert first == second == _guarded(data)
    verdict = HeadScanner().scan(data)
    if verdict is not None and verdict[0]:
        assert first == ("refused", verdict[0])


def _guarded(data: bytes) -> tuple[str, object]:
    """The guard's own answer for a fresh buffer of `data`, as _taken spells it."""
    scanner = HeadScanner()
    verdict = scanner.scan(data)
    if verdict is None:
        return "head", (None, data)
    if verdict[0]:
        return "refused", verdict[0]
    end = int(verdict[1])
    return "head", (data[scanner.start : end], data[end:])


@pytest.mark.parametrize("after", [b"", b"ok", b"\r\n", b"\x00\n\r", b"HTTP/1.1 200 OK\r\n\r\n"])
def test_a_remembered_head_with_other_bytes_after_it_answers_as_the_guard(after: bytes) -> None:
    """A head remembered from one read passes again at the start of another whatever follows it
    (a body, a pipelined head): its end is where the guard ends it, and the rest stays in the buffer."""
    for head in (
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n",
        b"GET http://a.test/ HTTP/1.1\r\nHost: a.test\r\n\r\n",
        b"GET http://a.test/ HTTP/1.1\r\nX-A: a\rB\r\n\r\n",  # refused: never remembered
    ):
        for data in (head, head + b"ab", head + after, head + after):
            assert _taken(data) == _guarded(data), data


# -- CONNECT heads ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("head", "expect"),
    [
        (b"CONNECT up.test:443 HTTP/1.1\r\nHost: up.test:443\r\n\r\n", ("up.test", 443, None)),
        (b"CONNECT up.test:443 HTTP/1.1\r\n\r\n", ("up.test", 443, None)),  # no Host: fine for CONNECT
        (b"CONNECT [2001:db8::1]:8443 HTTP/1.0\r\n\r\n", ("2001:db8::1", 8443, None)),
        (
            b"CONNECT up.test:443 HTTP/1.1\r\nProxy-Authorization:  Basic abc \r\n\r\n",
            ("up.test", 443, "Basic abc"),
        ),
        (b"CONNECT up.test:443 HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", ("up.test", 443, None)),
    ],
)
def test_a_connect_head_is_read(head: bytes, expect: tuple[str, int, str | None]) -> None:
    connect = read_connect(head)
    assert (connect.host, connect.port, connect.authorization) == expect


@pytest.mark.parametrize(
    "head",
    [
        b"CONNECT up.test HTTP/1.1\r\n\r\n",  # no port
        b"CONNECT up.test:0 HTTP/1.1\r\n\r\n",
        b"CONNECT up.test:65536 HTTP/1.1\r\n\r\n",
        b"CONNECT up.test:+443 HTTP/1.1\r\n\r\n",
        b"CONNECT :443 HTTP/1.1\r\n\r\n",
        b"CONNECT up.test:443 HTTP/2.0\r\n\r\n",
        b"CONNECT up.test:443\r\n\r\n",
        b"CONNECT  up.test:443 HTTP/1.1\r\n\r\n",
        b"CONNECT caf\xe9.test:443 HTTP/1.1\r\n\r\n",  # a non-ASCII byte: refused and recorded
        b"GET up.test:443 HTTP/1.1\r\n\r\n",
        b"CONNECT up.test:443 HTTP/1.1\r\nProxy-Authorization: a\r\nProxy-Authorization: b\r\n\r\n",
        b"CONNECT up.test:443 HTTP/1.1\r\nbad header\r\n\r\n",
    ],
)
def test_a_malformed_connect_head_is_refused(head: bytes) -> None:
    with pytest.raises(WireError):
        read_connect(head)


def test_a_request_head_read_again_answers_as_read_first() -> None:
    """read_request remembers short heads by their exact bytes: the same bytes, the same answer
    (and each connection its own body reader); a refused head is refused every time, with the
    request it could read; a long head is never kept."""
    from egressd.wire import http1

    head = b"POST http://up.test/x HTTP/1.1\r\nHost: up.test\r\nContent-Length: 3\r\n\r\n"
    first = http1.read_request(head)
    assert http1.read_request(bytes(head)) == first == http1._read_request(head)
    assert first[1:] == (3, False, True)
    sides = [ClientSide(), ClientSide()]
    for side in sides:
        assert [type(e) for e in side.receive(head + b"ab")] == [RequestHead, Body]
    assert sides[0].receive(b"c") == [Body(b"c"), End()] and sides[1].receive(b"c") == [Body(b"c"), End()]
    bad = b"GET http://up.test/ HTTP/1.1\r\nHost: up.test\r\nHost: other.test\r\n\r\n"
    for _ in range(3):
        side = ClientSide()
        with pytest.raises(WireError) as raised:
            side.receive(bad)
        assert raised.value.head is not None and side.request is raised.value.head
        assert raised.value.head.host == "up.test"
    long_head = b"GET http://up.test/ HTTP/1.1\r\nX-Pad: " + b"a" * 3000 + b"\r\n\r\n"
    assert http1.read_request(long_head)[0].host == "up.test"
    assert long_head not in http1._read_requests
    for n in range(400):  # bounded: forgotten all at once when full
        http1.read_request(b"GET http://h%d.test/ HTTP/1.1\r\n\r\n" % n)
        assert 0 < len(http1._read_requests) <= REMEMBERED_HEADS


@pytest.mark.parametrize("version", [b"HTTP/2.0", b"HTTP/1.2", b"HTTP/0.9"])
def test_a_request_of_another_http_version_is_refused(version: bytes) -> None:
    with pytest.raises(WireError):
        ClientSide().receive(b"GET http://a.test/ " + version + b"\r\nHost: a.test\r\n\r\n")
